"""A curriculum's training rows (``task.stages``): one row sequence per stage, read in order.

:class:`StagedRows` is every stage's training rows end to end (a ``Sequence``, as a task's
``train`` is) plus which step each stage ends at and the replay share. Which stage a step reads
follows from the member's step count (part of its state), and where in that stage it reads from
is the member's data position (:class:`pbt.algorithms.data.order.EpochOrder`: one epoch stream
per stage), so a copied or resumed member goes on in its parent's stage, at its parent's place.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, overload

from pbt.config import TaskConfig
from pbt.config.sections.task import StageConfig


class StagedRows(Sequence[Any]):
    """Every stage's training rows end to end.

    Args:
        parts: Each stage's training rows, in order.
        until: The step each stage ends at (None for the last: to the end).
        replay: The share of a step's prompts drawn from the earlier stages' rows.
    """

    def __init__(self, parts: list[Sequence[Any]], until: list[int | None], replay: float) -> None:
        self.parts = parts
        self.until = until
        self.replay = replay
        self.offsets = [0]
        for part in parts:
            self.offsets.append(self.offsets[-1] + len(part))

    def __len__(self) -> int:
        return self.offsets[-1]

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        stage = bisect.bisect_right(self.offsets, i) - 1
        return self.parts[stage][i - self.offsets[stage]]

    def stage_at(self, step: int) -> int:
        """The stage that step ``step`` (0 for a member's first) reads."""
        for stage, end in enumerate(self.until):
            if end is None or step < end:
                return stage
        return len(self.parts) - 1

    def size(self, stage: int) -> int:
        """How many training rows ``stage`` has."""
        return len(self.parts[stage])


def stage_config(cfg: TaskConfig, stage: StageConfig) -> TaskConfig:
    """The task section of one stage alone: the stage's rows with the task's other keys."""
    return replace(
        cfg,
        stages=[],
        replay=0.0,
        name=stage.name,
        train=stage.train,
        eval=stage.eval,
        options=stage.options or cfg.options,
        train_size=stage.train_size if stage.train_size is not None else cfg.train_size,
    )


def load_staged(
    cfg: TaskConfig, base_dir: str | Path, seed: int, load_one: Callable[..., Any]
) -> tuple[StagedRows, list[Any], Any]:
    """Each stage loaded by ``load_one(stage_cfg, base_dir, seed) -> Task``: the staged training
    rows, every stage's held-out rows together (``eval_size`` each, so their mean is the mean
    over stages), and the first stage's reward (the same for all: the manifest's, or the one
    task's own)."""
    tasks = [load_one(stage_config(cfg, stage), base_dir, seed) for stage in cfg.stages]
    train = StagedRows(
        [task.train for task in tasks], [stage.until_step for stage in cfg.stages], cfg.replay
    )
    held_out = [row for task in tasks for row in task.eval]
    return train, held_out, tasks[0].reward
