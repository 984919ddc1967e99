"""Dedicated rollout engines as the launcher and ``pbt status`` see them, torch-free.

Two things cross between processes here:

- **Where a member's engines run.** The launcher decides it (:mod:`pbt.launch.placement`) and
  hands it to every process of the member in :data:`PLACEMENT_ENV` (an
  :class:`EnginePlacement`): ``dedicated`` engines sit on GPUs of their own, listed in the
  member's ``CUDA_VISIBLE_DEVICES`` after its trainer GPUs (the engine of local rank ``r``
  takes logical device ``ranks + r``); ``shared`` engines are processes of their own on their
  trainer rank's GPU (under MPS); ``cpu`` engines are processes on the CPU.
- **What each engine did.** Its trainer rank rewrites ``<task_dir>/engines/rank-<r>.json``
  (an :class:`EngineStatus`) atomically about once a second while the member trains, and once
  more when the engine drains or fails; ``pbt status`` reads it, for running and finished
  members alike.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pbt.protocol.files import read_json, write_json_atomic

PLACEMENT_ENV = "PBT_ROLLOUT_PLACEMENT"
"""The variable that carries a member's :class:`EnginePlacement` (``kind:engines``)."""

PLACEMENTS = ("colocated", "dedicated", "shared", "cpu")
"""``colocated``: no engine, the trainer samples itself; ``dedicated``: each engine on a GPU of
its own; ``shared``: each engine its own process on its trainer rank's GPU (MPS lets their
kernels overlap); ``cpu``: each engine its own process on the CPU."""

ENGINES_DIR = "engines"
"""The folder of a task that holds its engines' status files."""


@dataclass(frozen=True, slots=True)
class EnginePlacement:
    """Where the engines of a member run, and how many it has (``auto`` resolved)."""

    kind: str
    """One of :data:`PLACEMENTS`."""
    engines_per_member: int
    """Engines of the member, one per trainer rank (0 when ``colocated``)."""

    def to_env(self) -> str:
        """The value of :data:`PLACEMENT_ENV`."""
        return f"{self.kind}:{self.engines_per_member}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EnginePlacement | None:
        """The placement :data:`PLACEMENT_ENV` names (default: this process's environment);
        None when it is unset or malformed (a member started by hand, library mode)."""
        value = (os.environ if environ is None else environ).get(PLACEMENT_ENV, "")
        kind, _, count = value.partition(":")
        if kind not in PLACEMENTS or not count.isdigit():
            return None
        return cls(kind, int(count))


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One engine of a member, as its trainer rank last saw it."""

    member_id: str
    rank: int
    """The trainer rank the engine samples for."""
    pid: int | None
    """The engine process's id (None once it is stopped)."""
    trainer_pid: int
    """The id of the trainer rank's process, which started the engine."""
    device: str
    """Where the engine samples: ``cpu``, or ``cuda:N`` with the physical GPU in brackets,
    e.g. ``cuda:1 (GPU 5)``."""
    placement: str
    """One of :data:`PLACEMENTS`."""
    state: str
    """``serving`` while the member trains, ``drained`` after it, ``failed`` when it could not
    be brought back."""
    version: int
    """The adapter version (optimizer steps of this session) the engine confirmed serving."""
    heartbeat: float | None
    """Wall time of the engine's last heartbeat, as the trainer read it."""
    restarts: int
    """Times the engine was restarted after dying or hanging."""
    stale_dropped: int
    """Sampled rows dropped this session for lagging past ``rollout.max_staleness``."""
    written: float
    """Wall time of this report."""

    def to_json(self) -> dict[str, Any]:
        """The file's JSON object."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> EngineStatus | None:
        """The status in ``obj``; None when it is not one (a damaged or foreign file)."""
        if not isinstance(obj, dict) or {f.name for f in fields(cls)} - set(obj):
            return None
        ints = ("rank", "trainer_pid", "version", "restarts", "stale_dropped")
        if not all(isinstance(obj[k], int) and not isinstance(obj[k], bool) for k in ints):
            return None
        if not all(isinstance(obj[k], str) for k in ("member_id", "device", "placement", "state")):
            return None
        beat = obj["heartbeat"]
        if beat is not None and not (isinstance(beat, int | float) and math.isfinite(beat)):
            return None
        if not isinstance(obj["written"], int | float) or (
            obj["pid"] is not None and not isinstance(obj["pid"], int)
        ):
            return None
        return cls(**{f.name: obj[f.name] for f in fields(cls)})

    def line(self, now: float) -> str:
        """The engine in one line of ``pbt status``."""
        pid = "-" if self.pid is None else str(self.pid)
        beat = "none" if self.heartbeat is None else f"{max(0.0, now - self.heartbeat):.0f} s ago"
        return (
            f"engine {self.rank}: pid {pid} on {self.device} ({self.placement}), {self.state}, "
            f"adapter v{self.version}, heartbeat {beat}, restarts {self.restarts}, "
            f"stale_dropped {self.stale_dropped}"
        )


def status_path(task_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where the engine of trainer rank ``rank`` reports, in a task's folder."""
    return Path(task_dir) / ENGINES_DIR / f"rank-{rank}.json"


def write_status(task_dir: str | os.PathLike[str], status: EngineStatus) -> None:
    """Replace the engine's status file (atomic; a write that fails is not worth a member)."""
    path = status_path(task_dir, status.rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, status.to_json(), durable=False)
    except OSError:
        pass


def read_statuses(task_dir: str | os.PathLike[str]) -> list[EngineStatus]:
    """The statuses of a task's engines, by rank; damaged files are left out."""
    found = []
    for path in sorted((Path(task_dir) / ENGINES_DIR).glob("rank-*.json")):
        status = EngineStatus.from_json(read_json(path))
        if status is not None:
            found.append(status)
    return sorted(found, key=lambda s: s.rank)
