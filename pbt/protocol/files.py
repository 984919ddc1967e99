"""The files a controller and a member exchange: JSON written atomically, read tolerantly,
and the heartbeat a live member touches (and fills with its progress)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
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
