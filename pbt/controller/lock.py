"""The controller lock: one controller per campaign, and no lock that outlives its controller.

``<campaign>/controller.lock`` is ``flock``-ed by the controller that runs the campaign and
names it: ``{"pid", "start_time", "host", "slurm_job"}``, where ``start_time`` is the process's
start in clock ticks after boot (``/proc/<pid>/stat`` field 22), which tells the holder from a
later process given the same pid. An flock belongs to the open file description, not to the
process: it lasts while any process still holds a descriptor of it. So:

- The descriptor is close-on-exec, and ``subprocess`` closes every other descriptor too: no
  member or worker ever holds it. A child forked without an exec (``os.fork``, multiprocessing's
  ``fork``) closes it at once (:func:`os.register_at_fork`).
- A controller killed with SIGKILL holds the lock until its exit has closed its files, which is
  not the moment the kill returns: a process in uninterruptible I/O (an fsync on a busy disk)
  dies only when the I/O completes. A new controller that finds the holder exiting waits for
  it, up to :data:`EXIT_WAIT_S`, instead of giving up.
- A lock that is held although its holder has ended, or although its pid now names another
  process (another start time; with no start time recorded, a command line that is not pbt's),
  is stale: some other process kept a copy of the descriptor (a child caught between its fork
  and its exec when the group was killed). A new controller takes it over, in one line: it puts
  a fresh lock file in the old one's place and locks that; the old file, unlinked, binds no one.
  A live controller's lock is refused, naming its pid and host.

Those decisions are taken under a second lock, ``controller.lock.guard``, held only for the
milliseconds they take, so that two controllers deciding at once never both take a lock over
and a reader never sees a half-written record.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pbt.config.errors import PbtError

LOCK_FILE = "controller.lock"
GUARD_FILE = "controller.lock.guard"
EXIT_WAIT_S = 60.0
"""How long a new controller waits for a killed one to finish exiting (and free the lock)."""
GUARD_WAIT_S = 10.0
"""How long to wait for the guard, which another process holds for milliseconds at a time."""
POLL_S = 0.05
_PF_EXITING = 0x4
"""The kernel's task flag of a process that has begun to exit (``/proc/<pid>/stat`` field 9)."""
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)

_HELD: set[int] = set()
"""This process's open descriptors of lock and guard files, closed in a forked child."""


def _close_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy only: the parent's lock stands
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)

Verdict = Literal["live", "exiting", "stale"]


class ControllerLock:
    """The campaign's controller lock, held by this process until :meth:`close`."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, directory: Path, say: Callable[[str], None] = print) -> ControllerLock:
        """Lock ``directory``'s campaign for this process: wait for a holder that is exiting,
        take over a stale lock (saying so with ``say``).

        Raises:
            PbtError: a live controller holds it (the message names its pid and host), or a
                killed one has not exited after :data:`EXIT_WAIT_S`.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        waiting_since = None
        while True:
            with _guard(directory):
                fd = _open(path)
                try:
                    if _try_lock(fd):
                        _write_record(fd)
                        return cls(fd, path)
                    record = _read_record(fd)
                    verdict, why = _judge(record)
                    if verdict == "stale" and _try_lock(fd):
                        # the holder closed its files between the two looks: it exited, and
                        # freed the lock; nothing was stale
                        _write_record(fd)
                        return cls(fd, path)
                    if verdict == "stale":
                        os.unlink(path)  # under the guard, the name is still fd's file
                except BaseException:
                    _close(fd)
                    raise
                _close(fd)
            if verdict == "stale":
                say(f"took over {path}: {why}")
                continue
            if verdict == "live":
                raise PbtError(
                    f"another controller is running this campaign: {why}; {_fix(directory)}"
                )
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
                say(f"waiting for the previous controller to exit: {why}")
            elif now - waiting_since > EXIT_WAIT_S:
                raise PbtError(
                    f"the previous controller still holds {path} after {EXIT_WAIT_S:g} s: "
                    f"{why}; try again once it has gone (ps -p {record.get('pid')})"
                )
            time.sleep(POLL_S)

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None and self._fd in _HELD:
            _close(self._fd)
        self._fd = None


def controller_running(directory: Path) -> dict[str, Any] | None:
    """Who holds the campaign's lock (``pid``, ``host``, ``slurm_job``, ``start_time``), or None
    when no controller runs it: the lock is free, or held only by a stale copy."""
    directory = Path(directory)
    path = directory / LOCK_FILE
    if not path.exists():
        return None
    with _guard(directory):
        try:
            fd = _open(path, create=False)
        except FileNotFoundError:
            return None
        try:
            if _try_lock(fd):
                return None  # closing the descriptor releases the probe's lock
            record = _read_record(fd)
        finally:
            _close(fd)
    verdict, _ = _judge(record)
    return None if verdict == "stale" else record


def last_controller(directory: Path) -> dict[str, Any] | None:
    """The record of the controller that last took the campaign's lock (``pid``, ``host``,
    ...), whether or not it still runs; None when no controller ever did. Read without the
    lock, for a display: a controller taking it at this moment may not have written it yet."""
    try:
        record = json.loads((Path(directory) / LOCK_FILE).read_bytes() or b"{}")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record else None


def _judge(record: dict[str, Any]) -> tuple[Verdict, str]:
    """Whether the controller a held lock's ``record`` names is alive, exiting, or gone (the
    lock then stale), and why, in words."""
    pid, host = record.get("pid"), record.get("host")
    if not isinstance(pid, int):
        return "stale", f"it names no controller ({record or 'empty'})"
    here = socket.gethostname()
    who = f"pid {pid} on {host or here}" + (
        f" (Slurm job {record['slurm_job']})" if record.get("slurm_job") else ""
    )
    if host not in (None, here):  # another machine's processes can't be seen from here
        return "live", f"{who} holds the lock"
    process = _process(pid)
    if process is None or process.ended:
        return "stale", f"its controller, {who}, has ended; another process kept a copy of it"
    started = record.get("start_time")
    if started is not None and process.start_time is not None and started != process.start_time:
        return "stale", f"pid {pid} is now another process (its controller has ended)"
    if started is None and process.cmdline is not None and "pbt" not in process.cmdline:
        return "stale", f"pid {pid} now runs {process.cmdline[:80]!r}, not a pbt controller"
    if process.exiting:
        return "exiting", f"{who} was killed and is exiting"
    return "live", f"{who} holds the lock"


@dataclass(frozen=True, slots=True)
class _Process:
    start_time: int | None
    """Clock ticks after boot; None where there is no ``/proc``."""
    exiting: bool
    """Killed (SIGKILL pending) or exiting, some thread still alive: its files will close."""
    ended: bool
    """A zombie: every thread has exited and its files are closed."""
    cmdline: str | None


def _process(pid: int) -> _Process | None:
    """What ``/proc`` says of ``pid``; None when no such process exists."""
    folder = Path(f"/proc/{pid}")
    if not Path("/proc/self/stat").exists():  # no procfs: only whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return _Process(None, exiting=False, ended=False, cmdline=None)
    try:
        state, flags, start_time = _stat((folder / "stat").read_text())
        status = (folder / "status").read_text()
        cmdline = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    threads = _thread_states(folder) or [state]
    ended = all(s in "ZX" for s in threads)
    killed = any(
        line.split(":")[0] in ("SigPnd", "ShdPnd") and int(line.split()[1], 16) & _SIGKILL_BIT
        for line in status.splitlines()
    )
    exiting = not ended and (bool(flags & _PF_EXITING) or killed or state in "ZX")
    return _Process(start_time, exiting=exiting, ended=ended, cmdline=cmdline.strip())


def _stat(text: str) -> tuple[str, int, int]:
    """State, flags and start time from ``/proc/<pid>/stat`` (fields 3, 9 and 22; the command
    name, field 2, may hold spaces and parentheses)."""
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[6]), int(fields[19])


def _thread_states(folder: Path) -> list[str]:
    states = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in (folder / "task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                states.append(_stat((task / "stat").read_text())[0])
    return states


@contextlib.contextmanager
def _guard(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s guard lock: decisions about the controller lock are taken under it."""
    path = directory / GUARD_FILE
    fd = _open(path)
    try:
        deadline = time.monotonic() + GUARD_WAIT_S
        while not _try_lock(fd):
            if time.monotonic() > deadline:
                raise PbtError(
                    f"{path} stays locked for more than {GUARD_WAIT_S:g} s, though a pbt "
                    "process holds it only while it takes the controller lock; if no pbt "
                    f"process is starting on this campaign, delete {path} and try again"
                )
            time.sleep(POLL_S)
        yield
    finally:
        _close(fd)


def _open(path: Path, create: bool = True) -> int:
    """A descriptor of ``path`` that no exec'd child inherits, closed in forked ones."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    _HELD.add(fd)
    return fd


def _close(fd: int) -> None:
    _HELD.discard(fd)
    os.close(fd)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _write_record(fd: int) -> None:
    me = _process(os.getpid())
    record = {
        "pid": os.getpid(),
        "start_time": me.start_time if me is not None else None,
        "host": socket.gethostname(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def _read_record(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _fix(directory: Path) -> str:
    return f"stop it with: pbt stop {directory}, or wait for it to finish"


__all__ = ["ControllerLock", "controller_running", "last_controller"]
