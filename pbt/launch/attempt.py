"""What a launcher runs and reports, shared by every launcher and the hand-ahead: one attempt at
one member task (:class:`TaskSpec`), how it ended (:class:`Outcome`), and the launcher's record
of an attempt it has started (:class:`Running`). No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pbt.launch.processes import ProcessGroup
from pbt.protocol.messages import ResultMessage

OutcomeStatus = Literal[
    "ok",
    "failed",
    "timeout",
    "no_heartbeat",
    "no_result",
    "bad_result",
    "out_of_memory",
    "disk_full",
    "diverged",
    "reward_error",
    "config_error",
    "bad_checkpoint",
    "cancelled",
    "preempted",
    "node_fail",
]


@dataclass(frozen=True)
class TaskSpec:
    """One attempt at one member task."""

    task_id: str
    task_dir: Path
    """Holds ``task.json`` (written by the caller); ``result.json`` and ``heartbeat`` go here."""
    log_path: Path
    """Receives this attempt's stdout and stderr."""
    nproc: int = 1
    """Processes (ranks) in the task's torchrun group."""
    adopt: str | None = None
    """A job a previous controller started for this very attempt, to watch instead of starting
    one (see :meth:`ProcessBackend.take_over <pbt.launch.backend.ProcessBackend.take_over>`);
    local process groups are never adopted."""


@dataclass(frozen=True)
class Outcome:
    """How one task attempt ended."""

    task_id: str
    status: OutcomeStatus
    returncode: int | None
    result: ResultMessage | None
    """The member's result: an ok task's, or a bad one's when it could be read."""
    detail: str
    """In words: exit code or signal, seconds without heartbeat, the last lines of the log."""
    seconds: float


@dataclass
class Running:
    """A task attempt a launcher has started (or handed to a worker that will start it)."""

    index: int
    task: TaskSpec
    slot: int
    port: int
    proc: ProcessGroup
    """The group that runs it: its own, or (handed to a long-lived worker) the worker's."""
    started: float  # time.monotonic()
    started_wall: float  # time.time(), to compare with the heartbeat's mtime
    released: bool = False  # its slot was handed on before it ended (see RELEASED)
    behind: Running | None = None
    """The task its worker runs before this one, when it was handed over ahead (see
    :attr:`LocalLauncher.ahead`)."""
    taken: bool = False  # handed ahead, and its worker has started it (it heartbeats)
    ended: bool = False
