"""Faults a member reports by kind: out of memory, a full disk, and diverged training. No torch
here.

A member process that fails for want of memory (``MemoryError``, ``torch.OutOfMemoryError``,
CUDA's or the CPU allocator's out-of-memory errors) or of disk space (``ENOSPC``, ``EDQUOT``,
``EFBIG``, a checkpoint that could not be written for one of them) says so in ``fault.json`` in
its task folder before it exits non-zero. The launcher reads it back, so the campaign records
``out_of_memory`` or ``disk_full`` with the member's own message rather than a bare exit code.
A process that ran out of memory before it could write the file (torchrun's agent, or an import)
is recognised by the last line of its log, Python's ``MemoryError``; one that could not write the
file because the disk is full, by the error it printed last.

A member whose loss or gradient stayed NaN or inf for ``algorithm.max_nonfinite_steps`` steps in
a row raises :class:`~pbt.config.errors.DivergedError` and is recorded as ``diverged``: like a
failed member, it is retried from its parent and then replaced.

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
from pathlib import Path
from typing import Literal

from pbt.config.errors import DivergedError
from pbt.protocol.files import read_json, write_json_atomic

FAULT_FILE = "fault.json"
FaultKind = Literal["out_of_memory", "disk_full", "diverged"]
KINDS: tuple[FaultKind, ...] = ("out_of_memory", "disk_full", "diverged")
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
    """``out_of_memory``, ``disk_full``, ``diverged``, or None for any other error.

    The error and the errors it was raised from or while handling are looked at, so a
    checkpoint write that failed for a full disk counts as ``disk_full``. torch is never
    imported: its out-of-memory errors are known by name and message.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DivergedError):
            return "diverged"
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
    return None


def report(task_dir: str | Path, err: BaseException) -> FaultKind | None:
    """Write ``fault.json`` for ``err`` if it is a fault of a known kind; returns the kind.

    Never raises: with the disk full, the file may not be written, and the exit code and the
    log still tell the controller that the member failed.
    """

    kind = classify(err)
    if kind is not None:
        with contextlib.suppress(OSError):
            message = f"{type(err).__name__}: {err}".strip()
            write_json_atomic(Path(task_dir) / FAULT_FILE, {"kind": kind, "error": message})
    return kind


def read(task_dir: str | Path, log_tail: str = "") -> tuple[FaultKind, str] | None:
    """The fault a failed member reported, as (kind, message), or None.

    ``fault.json`` first; else a log whose last line is a ``MemoryError``, or whose last lines
    say the disk is full.
    """

    fault = read_json(Path(task_dir) / FAULT_FILE)
    if fault is not None and fault.get("kind") in KINDS:
        return fault["kind"], str(fault.get("error", ""))
    lines = log_tail.strip().splitlines()
    if lines and _OOM_LAST_LINE.match(lines[-1]):
        return "out_of_memory", lines[-1]
    full = [line for line in lines if _DISK_FULL_TEXT.search(line)]
    if full:
        return "disk_full", full[-1]
    return None
