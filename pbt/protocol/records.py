"""The controller's picture of a population: plain records, no torch.

A :class:`MemberRecord` is what the campaign store keeps for one member of one generation; the
checkpoint it points to holds the weights. Selection, mutation, the store and the launcher all
speak in these records.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["pending", "running", "done", "failed"]


@dataclass(kw_only=True, slots=True)
class MemberRecord:
    """One member of one generation."""

    member_id: str
    """Stable name of this member slot's lineage entry, e.g. ``g003-m02``."""
    generation: int
    parent_id: str | None = None
    """The member this one was cloned from (None in generation 0)."""
    parent_checkpoint: str | None = None
    """Checkpoint to start from, relative to the campaign directory (None: the base model)."""
    hyperparameters: dict[str, float] = field(default_factory=dict)
    """Values to apply after loading the parent checkpoint."""
    mutation: str | None = None
    """What mutation made this member from its parent, in words (``lr x1.2``, ``none``)."""
    checkpoint: str | None = None
    """This member's own checkpoint once trained, relative to the campaign directory."""
    checkpoint_digest: str | None = None
    fitness_history: list[float] = field(default_factory=list)
    """Every evaluation of this lineage so far, the parent's included."""
    status: Status = "pending"
    attempts: int = 0
    steps: int = 0
    """Training steps of the lineage so far."""
    collapsed: bool = False
    """Its task ended early for lack of signal (:mod:`pbt.protocol.collapse`): its fitness was
    measured, but selection replaces it."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Figures of its own training for status tables: the zero-signal fraction of its steps
    (mean and last) and its trained steps (:func:`pbt.protocol.collapse.signal_summary`)."""

    def fitness(self, window: int = 1) -> float:
        """Mean of the last ``window`` evaluations; ``-inf`` when there is none."""
        if not self.fitness_history:
            return -math.inf
        recent = self.fitness_history[-window:]
        return sum(recent) / len(recent)


def member_id(generation: int, slot: int) -> str:
    """The id of the member in ``slot`` of ``generation``: ``g003-m01``. Ids sort by
    generation, then slot, and are plain names (safe as folder names)."""
    return f"g{generation:03d}-m{slot:02d}"


def member_seed(campaign_seed: int, member_id: str) -> int:
    """A member's seed: fixed by the campaign seed and the member's id, so a re-run task
    (after a crash or a retry) samples exactly what the first attempt did, and a library-mode
    member samples what the same member of a campaign would."""
    return (campaign_seed * 1_000_003 + zlib.crc32(member_id.encode())) % (2**31 - 1)


def rng_to_json(rng: random.Random) -> list:
    """A ``random.Random``'s state as JSON-able data."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_json(state: list) -> random.Random:
    """The ``random.Random`` whose state :func:`rng_to_json` gave."""
    version, internal, gauss = state
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss))
    return rng
