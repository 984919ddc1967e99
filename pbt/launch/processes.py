"""Process groups on this machine: what a started group is to a launcher
(:class:`ProcessGroup`), starting one under a memory limit, stopping groups with a grace
period, saying how they ended, and ending what a crashed controller left behind. No torch
here."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pbt.protocol.controller import CAMPAIGN_ENV

KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when a task's process group is stopped."""
JOB_CANCEL_WAIT_S = 120.0
"""Seconds to wait for a cancelled job to end (Slurm's KillWait is 30 s by default)."""
LOG_TAIL_LINES = 20


class ProcessGroup(Protocol):
    """A member's started process group as a launcher sees it, whatever runs it: the part of
    :class:`subprocess.Popen`'s interface the launchers use (a Slurm job has it too)."""

    pid: int
    """The group's id: its leader's pid (the process group id), or a job's id."""

    def poll(self) -> int | None:
        """The exit code once the group has ended (``-signal`` when a signal ended it), else
        None."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; the exit code. Raises :class:`subprocess.TimeoutExpired`."""
        ...


def memory_limiter(limit: int) -> Callable[[], None]:
    """What the child runs before exec: cap its data segment (inherited by every process it
    starts) at ``limit`` bytes, or the hard limit if that is lower."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return apply


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kill_groups(procs: list[ProcessGroup]) -> list[int]:
    """SIGTERM each local process group, SIGKILL what is left after ``KILL_GRACE_S``; return
    exit codes.

    The groups share one grace period, so stopping many tasks takes no longer than one.
    """
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_group(proc.pid, signal.SIGKILL)  # whatever is left in the group, leader or not
    return [proc.wait() for proc in procs]


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_bytes()[-64 * 1024 :].decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def kill_orphan(task_dir: Path, names: Path | None = None) -> bool:
    """End the process group a previous (crashed) controller started for ``task_dir``, and any
    process of it that left the group.

    The group is killed only while its leader's command line still names ``names`` (default
    the task's ``task.json``), so a recycled process id is never hit. torchrun starts each rank
    in a session of its own, so a group killed with SIGKILL can leave its ranks behind: every
    process whose command line names ``names`` is ended too, with its own group. Returns
    whether anything was killed.
    """
    marker = str(names or Path(task_dir) / "task.json").encode() + b"\0"  # a whole argument
    killed = []
    try:
        pgid = int((Path(task_dir) / "pgid").read_text())
        if marker in Path(f"/proc/{pgid}/cmdline").read_bytes():
            _signal_group(pgid, signal.SIGKILL)
            killed.append(pgid)
    except (OSError, ValueError):
        pass
    for pid in _processes_naming(marker):
        with contextlib.suppress(OSError):
            _signal_group(os.getpgid(pid), signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    deadline = time.monotonic() + KILL_GRACE_S
    while any(_alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(killed)


def end_campaign_processes(directory: Path) -> list[int]:
    """SIGKILL every live process (but this one) whose environment names the campaign in
    ``directory`` (``PBT_CAMPAIGN``, which the local launcher gives every member process and
    each of their children inherits), and wait for them to go; returns their ids.

    Called by a controller that holds the campaign's lock, before it starts anything and before
    it exits: whatever is found then is a killed predecessor's, or its own that a stopped
    group left behind (torchrun's ranks run in sessions of their own). Slurm jobs never carry
    the variable: they are adopted or cancelled, not found here.
    """
    marker = f"\0{CAMPAIGN_ENV}={Path(directory).resolve()}\0".encode()
    killed: list[int] = []
    for _ in range(3):  # a process caught starting a child: the child is found next time
        found = [pid for pid in _processes_with(marker, "environ") if pid not in killed]
        if not found:
            break
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        killed += found
        deadline = time.monotonic() + KILL_GRACE_S
        while any(_alive(pid) for pid in found) and time.monotonic() < deadline:
            time.sleep(0.02)
    return killed


def _processes_naming(marker: bytes) -> list[int]:
    """Live processes (not this one) whose command line contains ``marker``."""
    return _processes_with(marker, "cmdline")


def _processes_with(marker: bytes, part: str) -> list[int]:
    """Live processes (not this one) whose ``/proc/<pid>/<part>`` contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            text = b"\0" + Path(f"/proc/{entry}/{part}").read_bytes()  # each entry \0-framed
        except OSError:
            continue
        if marker in text and _alive(int(entry)):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
