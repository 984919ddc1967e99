"""A member's progress while it runs, carried by the heartbeat file it already writes.

The member (rank 0) reports through its :class:`~pbt.protocol.files.Heartbeat`: its phase
(``loading``, ``training``, ``evaluating``, ``saving``), and after each training step the
steps done of the task's steps, the step's mean reward and tokens per second, and the seconds
its training has left (the steps left times its mean step time so far). The controller and
``pbt status`` read it with :func:`read_progress`; the launcher still reads only the file's
modification time. A heartbeat without a payload (an older member, a member still starting,
a write cut off) reads as None: the member is alive, its progress unknown.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from pbt.protocol.files import Heartbeat, read_json

PHASES = ("loading", "training", "evaluating", "saving")
"""What a member does, in order: load its model and parent, train its steps, evaluate, save."""


@dataclass(frozen=True, slots=True)
class Progress:
    """One report of a member's progress (the heartbeat's JSON object)."""

    phase: str
    """One of :data:`PHASES`."""
    step: int = 0
    """Steps of this task done."""
    steps: int = 0
    """Steps this task trains (it may stop earlier, when the member collapses)."""
    reward: float | None = None
    """The last step's mean reward; None before a step, or for an algorithm without rewards."""
    tokens_per_s: float | None = None
    """The last step's tokens per second."""
    eta_s: float | None = None
    """Seconds of training left when this was written: the steps left x the mean step time."""
    time: float | None = None
    """Wall time (``time.time()``) when this was written."""

    def to_json(self) -> dict[str, Any]:
        """The heartbeat's payload."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Progress | None:
        """The progress in ``obj``; None when it is not a progress report. A field of the
        wrong type, or a number that is not finite, reads as unknown (its default)."""
        if not isinstance(obj, dict) or obj.get("phase") not in PHASES:
            return None
        counts = {k: int(obj[k]) for k in ("step", "steps") if _is_number(obj.get(k))}
        figures = {
            k: float(obj[k])
            for k in ("reward", "tokens_per_s", "eta_s", "time")
            if _is_number(obj.get(k))
        }
        return cls(obj["phase"], **counts, **figures)

    def eta_now(self, now: float | None = None) -> float | None:
        """Seconds of training left at wall time ``now`` (default: now): :attr:`eta_s` less
        the time since it was written; 0 once the member trains no more."""
        if self.phase in ("evaluating", "saving"):
            return 0.0
        if self.eta_s is None:
            return None
        age = 0.0 if self.time is None else (time.time() if now is None else now) - self.time
        return max(0.0, self.eta_s - max(0.0, age))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_progress(path: str | os.PathLike[str]) -> Progress | None:
    """The progress in heartbeat file ``path``; None when it is missing, empty or damaged."""
    return Progress.from_json(read_json(path))


class ProgressReport:
    """A task's progress, sent to its heartbeat as it changes (member side, rank 0).

    Reports ``loading`` at once. Without a heartbeat (ranks other than 0) it only counts.

    Args:
        heartbeat: where to write; None writes nothing.
        steps: the steps the task trains.
        clock: monotonic seconds, for the step times.
    """

    def __init__(
        self,
        heartbeat: Heartbeat | None,
        steps: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._heartbeat, self._clock = heartbeat, clock
        self._training_since: float | None = None
        self.progress = Progress("loading", steps=steps)
        self._send()

    def phase(self, name: str) -> None:
        """The member moved on to phase ``name`` (one of :data:`PHASES`)."""
        if name not in PHASES:
            raise ValueError(f"phase ({name!r}) must be one of {', '.join(PHASES)}")
        if name == "training":
            self._training_since = self._clock()
        self.progress = replace(self.progress, phase=name)
        self._send()

    def stepped(self, metrics: Mapping[str, float]) -> None:
        """One more training step is done, with these metrics (``reward_mean`` and
        ``tokens_per_s`` are read when present)."""
        if self._training_since is None:
            self.phase("training")
        done = self.progress.step + 1
        per_step = (self._clock() - self._training_since) / done
        self.progress = replace(
            self.progress,
            phase="training",
            step=done,
            reward=_figure(metrics.get("reward_mean")),
            tokens_per_s=_figure(metrics.get("tokens_per_s")),
            eta_s=per_step * max(0, self.progress.steps - done),
        )
        self._send()

    def _send(self) -> None:
        if self._heartbeat is not None:
            self.progress = replace(self.progress, time=time.time())
            self._heartbeat.report(self.progress.to_json())


def _figure(value: Any) -> float | None:
    return float(value) if _is_number(value) else None
