"""The files a controller and a member exchange: JSON written atomically, read tolerantly,
and the heartbeat a live member touches (and fills with its progress); and a folder built once
under a file lock (a converted or built-in model in the cache) that every process then reads."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

RELEASED = "released"
"""Written by a long-lived worker in a task's folder once the task no longer needs the device
(its state is in host memory, its checkpoint being written): the slot may take the next task.
It holds the task's result without the checkpoint's digest (``result.json`` follows once the
checkpoint is on disk)."""


def _json_beside(path: Path, obj: Any, durable: bool = True) -> str:
    """Write ``obj`` as JSON to a new temporary file in ``path``'s folder (flushed to the disk
    when ``durable``); its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def write_json_atomic(path: str | os.PathLike[str], obj: Any, durable: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` so that readers see the old file or the whole new one.

    ``durable=False`` skips the flushes to the disk: for a file rewritten every few seconds
    whose loss in a power cut costs nothing (a heartbeat's progress)."""
    path = Path(path)
    tmp = _json_beside(path, obj, durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if not durable:
        return
    with contextlib.suppress(OSError):  # make the rename durable; not every filesystem allows it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_json_once(path: str | os.PathLike[str], obj: Any) -> bool:
    """Write ``obj`` as JSON to ``path`` unless ``path`` exists; return whether it was written.

    Readers see no file or the whole of it: a complete temporary file is linked into place,
    which fails if another process linked its own first."""
    path = Path(path)
    tmp = _json_beside(path, obj)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: the last writer wins there
            if path.exists():
                return False
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


COMPLETE = ".complete"
"""The file a folder built by :func:`build_once` holds once its build finished."""


def build_once(folder: str | os.PathLike[str], build: Callable[[Path], None]) -> Path:
    """``folder``, built by ``build`` unless it is already complete; safe across processes.

    One process takes an ``fcntl`` lock beside the folder (``<folder>.lock``) and builds into a
    temporary sibling that is renamed into place; the others wait on the lock and then find the
    finished folder. ``build(tmp)`` writes the folder's files and, last, its :data:`COMPLETE`
    marker: a folder without it (an interrupted build) is built again, and the leftovers of
    interrupted builds are removed first. Every file of a built folder is readable by every
    user of a shared cache.

    Args:
        folder: Where the finished folder lives; its parent is created if missing.
        build: Writes the folder's contents into the empty folder it is given.

    Returns:
        ``folder``, as a path, complete.

    Raises:
        Whatever ``build`` raises; the temporary folder is removed first.
    """
    folder = Path(folder)
    if (folder / COMPLETE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (folder / COMPLETE).is_file():
                _build_in_place(folder, build)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder


def _build_in_place(folder: Path, build: Callable[[Path], None]) -> None:
    """Build into a temporary sibling of ``folder`` and rename it into place; lock held."""
    for stale in [folder, *folder.parent.glob(f".{folder.name}.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        build(tmp)
        for written in tmp.rglob("*"):
            written.chmod(0o755 if written.is_dir() else 0o644)
        tmp.chmod(0o755)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file is missing, truncated or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


class Heartbeat:
    """Touch ``path`` now and every ``interval_s`` seconds from a daemon thread, until exit.

    Used as ``with Heartbeat(task_dir / "heartbeat"): ...`` by the member (rank 0). Liveness is
    the file's modification time alone. Its content, once the member calls :meth:`report`, is
    the member's latest progress as a JSON object (:mod:`pbt.protocol.progress`), replaced
    atomically; an empty file is a heartbeat without progress.
    """

    def __init__(self, path: str | os.PathLike[str], interval_s: float = 2.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"Heartbeat interval_s ({interval_s}) must be > 0")
        self.path = Path(path)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Touch the file once; a vanished directory is not worth killing the member for."""
        with contextlib.suppress(OSError):
            self.path.touch()

    def report(self, payload: dict[str, Any]) -> None:
        """Replace the file's content with ``payload`` (a beat, too); like a beat, a failed
        write is not worth killing the member for."""
        with contextlib.suppress(OSError):
            write_json_atomic(self.path, payload, durable=False)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def __enter__(self) -> Heartbeat:
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="pbt-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
