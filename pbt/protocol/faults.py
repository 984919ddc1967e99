"""Faults a member reports by kind: out of memory, a full disk, and diverged training. No torch
here.

A member process that fails for want of memory (``MemoryError``, ``torch.OutOfMemoryError``,
CUDA's or the CPU allocator's out-of-memory errors) or of disk space (``ENOSPC``, ``EDQUOT``,
``EFBIG``, a checkpoint that could not be written for one of them) says so in ``fault.json`` in
its task folder before it exits non-zero. The launcher reads it back, so the campaign records
``out_of_memory`` or ``disk_full`` with the member's own message rather than a bare exit code.
A process that ran out of memory before it could write the file (torchrun's agent, or an import)
is recognised by the last line of its log, Python's ``MemoryError``; one that could not write the
file because the disk is full, by the error it printed last. Under ``launch.memory_limit_gib``
an allocation that fails inside a C extension does not always become a ``MemoryError`` (an
import can end in ``SystemError: error return without exception set``), so an error of a
process that holds 80% or more of its data limit counts as ``out_of_memory`` whatever its
type, and its cause says how much it held. The worker keeps a small reserve of memory that it
frees once it has judged the error, so that the report itself can be written at the limit.

A member whose loss or gradient stayed NaN or inf for ``algorithm.max_nonfinite_steps`` steps in
a row raises :class:`~pbt.config.errors.DivergedError` and is recorded as ``diverged``: like a
failed member, it is retried from its parent and then replaced. A reward function that raised
or returned something that is not a finite number, and did so again when called once more on the
same input, raises :class:`~pbt.config.errors.RewardError`, recorded as ``reward_error`` with its
one-line message: like ``config_error``, it is not retried (:data:`NOT_RETRIED`). A reward call
that ran past ``task.reward_timeout_s`` may have met a busy machine: a plain failure, retried.

A member that stops on a :class:`~pbt.config.errors.ConfigError` (a model that cannot be loaded,
a tokenizer without a chat template, a batch its ranks cannot split) is ``config_error``: the
same configuration fails the same way, so it is not retried. Nor is ``bad_checkpoint``: a
parent checkpoint refused on loading (:class:`~pbt.config.errors.CheckpointError` not caused by
an OS error: a digest that does not match, a missing manifest or file, a symbolic link, a path
that leaves its folder), which the same checkpoint reproduces; the member is replaced at once.

Whatever the error, the worker writes its one-line cause and the exit code it is about to exit
with into ``fault.json`` (``cause`` and ``exit_code``; ``kind`` is null for an error of no known
kind): torchrun's agent exits 1 whatever its worker's code, and the cause would otherwise be
only in the member's log. The first report of an attempt stands, so a rank that fails because a
peer died does not overwrite the peer's cause.

A member that stopped learning (no signal for ``algorithm.collapse_patience`` steps in a row) is
not a failure: retrying it would only repeat it. Its task ends early with a result (status
``ok``, evaluated and saved) whose ``fault`` kind is ``collapsed``
(:data:`pbt.protocol.collapse.COLLAPSED`); the campaign records it in its fault log and
selection replaces it.
"""

from __future__ import annotations

import contextlib
import errno
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pbt.config.errors import CheckpointError, ConfigError, DivergedError, PbtError, RewardError
from pbt.protocol.files import read_json, write_json_once

FAULT_FILE = "fault.json"
NEAR_LIMIT = 0.8
"""The share of its data limit (``RLIMIT_DATA``) past which a process's error counts as
``out_of_memory``."""
RESERVE_BYTES = 16 << 20
FaultKind = Literal[
    "out_of_memory", "disk_full", "diverged", "config_error", "reward_error", "bad_checkpoint"
]
KINDS: tuple[FaultKind, ...] = (
    "out_of_memory",
    "disk_full",
    "diverged",
    "config_error",
    "reward_error",
    "bad_checkpoint",
)
NOT_RETRIED: frozenset[str] = frozenset({"config_error", "reward_error", "bad_checkpoint"})
"""Fault kinds that the same task input reproduces (the manifest, the reward on the same rows,
a broken parent checkpoint): a campaign replaces such a member at once instead of spending
attempts on it."""
CAUSE_CHARS = 600
"""The most characters of a cause kept: a line a person reads, not a dump."""
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

_OOM_TEXT = re.compile(r"out of memory|can't allocate memory|not enough memory", re.IGNORECASE)
_OOM_LAST_LINE = re.compile(
    r"^([\w.]+\.)?(MemoryError|OutOfMemoryError)\b"
    r"|^(ImportError|OSError)\b.*failed to map segment from shared object"
)
# The dynamic loader's words when a shared library cannot be mapped for want of memory (an
# import under the memory limit fails so, as an ImportError or OSError).
_MAP_FAILED = re.compile(r"failed to map segment from shared object")
_DISK_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded|\((ENOSPC|EDQUOT)\b")


def classify(err: BaseException) -> FaultKind | None:
    """``out_of_memory``, ``disk_full``, ``diverged``, ``config_error``, ``reward_error``,
    ``bad_checkpoint``, or None for any other error.

    The error and the errors it was raised from or while handling are looked at, so a
    checkpoint write that failed for a full disk counts as ``disk_full``; a ConfigError counts
    only as the error itself, not as the context of another. torch is never imported: its
    out-of-memory errors are known by name and message.
    """
    if isinstance(err, ConfigError):
        return "config_error"
    if isinstance(err, CheckpointError) and err.__cause__ is None:  # not a failed write
        return "bad_checkpoint"
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DivergedError):
            return "diverged"
        if isinstance(err, RewardError):
            return "reward_error" if err.reproduced else None
        if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
            return "out_of_memory"
        if isinstance(err, OSError) and err.errno == errno.ENOMEM:
            return "out_of_memory"
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return "disk_full"
        if isinstance(err, RuntimeError) and _OOM_TEXT.search(str(err)):
            return "out_of_memory"
        if isinstance(err, (ImportError, OSError)) and _MAP_FAILED.search(str(err)):
            return "out_of_memory"
        err = err.__cause__ or err.__context__
    return "out_of_memory" if memory_held() is not None else None


_reserve: bytearray | None = None


def keep_reserve() -> None:
    """Set aside :data:`RESERVE_BYTES` that :func:`report` frees before it writes (a worker
    calls this at its start), so that a report at the memory limit has room to be written."""
    global _reserve
    _reserve = bytearray(RESERVE_BYTES)


def release_reserve() -> None:
    global _reserve
    _reserve = None


def memory_held() -> tuple[int, int] | None:
    """``(held, limit)`` in bytes when this process holds :data:`NEAR_LIMIT` or more of its
    data limit (``RLIMIT_DATA``, which the launcher sets from ``launch.memory_limit_gib``);
    None without a limit, below it, or where it cannot be read (not Linux)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
        if limit == resource.RLIM_INFINITY or limit <= 0:
            return None
        with open("/proc/self/status", encoding="ascii") as f:
            line = next(x for x in f if x.startswith("VmData:"))
        held = int(line.split()[1]) * 1024
    except MemoryError:
        return (limit, limit)  # nothing left to read with: at the limit
    except (ImportError, OSError, StopIteration, ValueError, IndexError):
        return None
    return (held, limit) if held >= NEAR_LIMIT * limit else None


def report(task_dir: str | Path, err: BaseException, exit_code: int = 2) -> FaultKind | None:
    """Write ``fault.json`` for ``err``: its kind (or null), its one-line cause and the
    ``exit_code`` the worker exits with; returns the kind. An earlier report of this attempt
    (another rank's) is kept.

    Never raises: with the disk full, or no memory left, the file may not be written, and the
    exit code and the log still tell the controller that the member failed.
    """
    kind, held = None, None
    with contextlib.suppress(Exception):
        kind = classify(err)  # what the process holds is judged with the reserve still held
        held = memory_held() if kind == "out_of_memory" else None
    release_reserve()
    with contextlib.suppress(Exception):
        message = f"{type(err).__name__}: {err}".strip()
        cause = one_line(err)
        if held is not None:
            cause = f"{cause} (at {held[0] / 2**30:.2f} GiB of its {held[1] / 2**30:.2f} GiB limit)"
        record = {"kind": kind, "error": message, "cause": cause, "exit_code": exit_code}
        write_json_once(Path(task_dir) / FAULT_FILE, record)
    return kind


def one_line(err: BaseException) -> str:
    """``err`` as one line a person can act on: a project error's own words (a ConfigError's
    problems joined by ``; ``), any other error's type and message."""
    if isinstance(err, ConfigError):
        text = "; ".join(err.problems)
    elif isinstance(err, PbtError):
        text = str(err)
    else:
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    text = " ".join(text.split())
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."


@dataclass(frozen=True, slots=True)
class Cause:
    """Why a member's worker failed, as it reported in ``fault.json``."""

    kind: FaultKind | None
    message: str
    """The error in one line (:func:`one_line`)."""
    exit_code: int | None
    """The code the worker exited with (torchrun's agent exits 1 whatever it was)."""


def read_cause(task_dir: str | Path) -> Cause | None:
    """The cause the member's worker reported before exiting, or None if it reported none."""
    fault = read_json(Path(task_dir) / FAULT_FILE)
    if fault is None or not fault.get("cause"):
        return None
    kind = fault.get("kind") if fault.get("kind") in KINDS else None
    code = fault.get("exit_code")
    return Cause(kind, str(fault["cause"]), code if isinstance(code, int) else None)


def read(task_dir: str | Path, log_tail: str = "") -> tuple[FaultKind, str] | None:
    """The fault a failed member reported, as (kind, message), or None.

    ``fault.json`` first; else a log whose last line is a ``MemoryError``, or whose last lines
    say the disk is full.
    """

    fault = read_json(Path(task_dir) / FAULT_FILE)
    if fault is not None and fault.get("kind") in KINDS:
        return fault["kind"], str(fault.get("error", ""))
    # a cause of no known kind that still reads as memory (an allocator's words, where the
    # error's type is not one classify() knows) counts as out of memory
    cause = "" if fault is None else str(fault.get("cause") or "")
    if _OOM_LAST_LINE.match(cause) or _OOM_TEXT.search(cause):
        return "out_of_memory", cause
    lines = log_tail.strip().splitlines()
    last = [line for line in lines[-3:] if _OOM_LAST_LINE.match(line)]
    if last:
        return "out_of_memory", last[-1]
    full = [line for line in lines if _DISK_FULL_TEXT.search(line)]
    if full:
        return "disk_full", full[-1]
    return None
