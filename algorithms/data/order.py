"""The data position of a member: which training rows it reads next.

Training reads the rows in epochs: each epoch is a permutation of every training row, drawn
from ``(seed, epoch)`` alone, and a cursor walks it, so every row is read once an epoch.
``(seed, epoch, cursor)`` is the member's whole data position: it goes into the checkpoint,
and a resumed, cloned or mutated member reads on from where its parent stopped. Only the
current epoch's permutation is held (8 bytes a row), made again when the epoch changes or a
position is loaded.

A curriculum (``task.stages``) reads each stage the same way, in its own epoch stream: the
position is then also the stage last read and ``[epoch, cursor]`` of every stage begun so far;
a step's replayed prompts (``task.replay``) are drawn uniformly from the earlier stages' rows
by a generator of ``(seed, step)`` alone, so they need no position of their own.
"""

from __future__ import annotations

import random
from typing import Any

import torch

EPOCH_SALT = 0x5EED_DA7A
"""Keeps the epochs' streams apart from every other use of a member's seed."""


class EpochOrder:
    """Row numbers for training steps, epoch by epoch.

    Args:
        seed: the stream the epochs' permutations are drawn from.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.epoch = 0
        self.cursor = 0
        self._order: torch.Tensor | None = None
        self._key: tuple[int, int, int] | None = None
        self.stage = 0
        """A curriculum: the stage the last step read."""
        self.stages: list[list[int]] = []
        """A curriculum: ``[epoch, cursor]`` of each stage begun."""
        self._streams: dict[int, EpochOrder] = {}

    def take_staged(self, train, step: int, count: int) -> list[int]:
        """The row numbers (into ``train``, a :class:`~pbt.algorithms.data.stages.StagedRows`) of
        step ``step``'s ``count`` prompts: each is a replay of an earlier stage with
        probability ``train.replay``, else the next row of the step's stage."""
        stage = train.stage_at(step)
        self.stage = stage
        while len(self.stages) <= stage:
            self.stages.append([0, 0])
        earlier = train.offsets[stage]
        draw = random.Random(f"replay:{self.seed}:{step}")
        replayed = [
            draw.randrange(earlier)
            for _ in range(count)
            if earlier and draw.random() < train.replay
        ]
        stream = self._streams.get(stage)
        if stream is None:
            stream = self._streams[stage] = EpochOrder(self.seed * 7_919 + stage)
        stream.epoch, stream.cursor = self.stages[stage]
        fresh = stream.take(train.size(stage), count - len(replayed))
        self.stages[stage] = [stream.epoch, stream.cursor]
        return [earlier + i for i in fresh] + replayed

    def take(self, rows: int, count: int) -> list[int]:
        """The next ``count`` row numbers of ``rows`` training rows; an epoch that runs out
        on the way is finished and the next one begun."""
        taken: list[int] = []
        while len(taken) < count:
            if self.cursor >= rows:
                self.epoch, self.cursor = self.epoch + 1, 0
            order = self._permutation(rows)
            end = min(rows, self.cursor + count - len(taken))
            taken += order[self.cursor : end].tolist()
            self.cursor = end
        return taken

    def _permutation(self, rows: int) -> torch.Tensor:
        key = (self.seed, self.epoch, rows)
        if self._key != key:
            generator = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.epoch * 7_919 + EPOCH_SALT) % 2**63
            )
            self._order = torch.randperm(rows, generator=generator)
            self._key = key
        assert self._order is not None
        return self._order

    def state_dict(self) -> dict[str, int]:
        """The position as plain numbers, for a checkpoint."""
        state: dict[str, Any] = {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor}
        if self.stages:
            state |= {"stage": self.stage, "stages": [list(p) for p in self.stages]}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position :meth:`state_dict` returned."""
        self.seed, self.epoch, self.cursor = (int(state[k]) for k in ("seed", "epoch", "cursor"))
        self.stage = int(state.get("stage", 0))
        self.stages = [[int(e), int(c)] for e, c in state.get("stages", [])]
        self._streams = {}

    def restart(self, seed: int) -> None:
        """Begin the first epoch of a new stream (a member that starts afresh)."""
        self.load_state_dict({"seed": seed, "epoch": 0, "cursor": 0})
