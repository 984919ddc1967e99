"""MLflow tracking that never blocks, slows or crashes training, and never loses what it logged.

This is the only module that imports MLflow, and it does so lazily, in a background thread:
``import mlflow`` costs seconds and the controller must start in well under one.

Every call of :class:`Tracker` appends one JSON event to ``journal.jsonl`` in its journal
directory and returns. One daemon thread owns an ``MlflowClient``, reads the unsent events in
order and sends them in batches; after each send it records in ``sent`` how far the journal is
acknowledged, and in ``runs.json`` which MLflow run each caller key maps to. A new
:class:`Tracker` on the same journal directory reuses those runs and replays whatever was not
acknowledged, so neither a crash nor an outage loses anything. A replayed send whose
acknowledgement was lost duplicates nothing: a metric keeps the timestamp it was logged with and
MLflow drops an exact duplicate, and tags, params (same value) and artifacts overwrite themselves.

Only the client API is used, never the fluent ``mlflow.start_run``, so an ``MLFLOW_RUN_ID`` or
``MLFLOW_EXPERIMENT_ID`` inherited from a parent shell can't redirect these runs.

A store that can't be reached (or any transient failure) is retried with backoff, in order,
with one warning when it goes and one when it is back. An event that MLflow refuses (a param
changing value, an invalid name) is skipped with a warning, so the queue never sticks.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from pbt.config.errors import PbtError
from pbt.protocol.files import read_json, write_json_atomic

_LOG = logging.getLogger("pbt.tracking.tracker")

JOURNAL_FILE = "journal.jsonl"
SENT_FILE = "sent"
RUNS_FILE = "runs.json"
END_STATUSES = ("FINISHED", "FAILED", "KILLED")
MAX_BACKOFF_S = 5.0
"""The longest wait between two attempts to reach MLflow."""
_FIRST_BACKOFF_S = 0.1
_COMPACT_BYTES = 64 << 20
"""A journal past this size is emptied once every event in it is acknowledged."""
_READ_AHEAD = 5000
_BATCH_LIMITS = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow's log_batch limits
# MLflow's defaults are a 120 s timeout and 7 retries with backoff (minutes per attempt).
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
# Error codes by which MLflow says "I looked at this and won't take it": retrying can't help.
_REFUSED = frozenset(
    {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE"}
)
_STOPPED = object()
_COPY_NAME = re.compile(r"[0-9a-f]{32}")
"""An artifact copy's folder name: ``uuid4().hex``."""


def default_uri(directory: Path | str) -> str:
    """The embedded store of a run directory: ``sqlite:///<absolute directory>/mlflow.db``."""
    return f"sqlite:///{Path(directory).resolve() / 'mlflow.db'}"


def _create_sqlite_store(uri: str, artifact_location: str | None) -> None:
    """Create a SQLite tracking store that does not exist yet, whole or not at all.

    MLflow builds a new store by running its schema migrations one by one; a process killed
    among them (a controller SIGKILLed seconds after it started) would leave a store that no
    later migration can finish. So the store is built beside its place and linked into it,
    which fails where another process has put its own store first.
    """
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///"))
    if path.exists():
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    for stale in path.parent.glob(f".{path.name}.creating-*"):
        if not _alive(stale.name.rpartition("-")[2]):  # left by a process killed here
            stale.unlink(missing_ok=True)
    building = path.with_name(f".{path.name}.creating-{os.getpid()}")
    store = SqlAlchemyStore(f"sqlite:///{building}", artifact_location or str(path.parent))
    store.engine.dispose()
    try:
        os.link(building, path)
    except FileExistsError:
        pass
    finally:
        building.unlink(missing_ok=True)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _default_artifact_location(uri: str) -> str | None:
    """``<directory of the database>/mlartifacts`` for a SQLite file store, else MLflow's default."""
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


@dataclass(slots=True)
class _Entry:
    """One journal line read back by the sending thread."""

    event: dict[str, Any]
    nbytes: int


class _Journal:
    """The on-disk state of a :class:`Tracker`: events, progress, run ids and artifact copies.

    Thread-safe. Counters ``logged`` and ``acked`` only grow; the journal file itself is emptied
    when it has grown large and everything in it is acknowledged.
    """

    def __init__(self, directory: Path, flush_every_s: float) -> None:
        self.directory = directory
        self.artifacts = directory / "artifacts"
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Condition()
        self.closed = False
        self._flush_every_s = flush_every_s
        self._runs: dict[str, str] = {
            str(k): str(v) for k, v in (read_json(directory / RUNS_FILE) or {}).items()
        }
        self._lock_fd = _lock_directory(directory)
        try:
            self.sent_lines, self.sent_offset, unsent, self.started = self._recover()
            self._file = open(directory / JOURNAL_FILE, "ab", buffering=0)  # noqa: SIM115
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.logged, self.acked = unsent, 0
        self._size = os.fstat(self._file.fileno()).st_size
        self._last_fsync = time.monotonic()

    def _recover(self) -> tuple[int, int, int, set[str]]:
        """Read progress, cut a line torn by a crash, and scan what is not yet acknowledged."""
        sent = read_json(self.directory / SENT_FILE) or {}
        lines, offset = sent.get("lines", 0), sent.get("offset", 0)
        if not (isinstance(lines, int) and isinstance(offset, int)):
            lines, offset = 0, 0  # unreadable progress: replay all, duplicates are harmless
        path = self.directory / JOURNAL_FILE
        path.touch()
        unsent, started, copies = 0, set(), set()
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if offset > size:  # emptied after everything was acknowledged, before `sent` said so
                lines, offset = 0, 0
            end = f.seek(offset)
            for line in f:
                if not line.endswith(b"\n"):
                    break  # the process died inside this write, so the call never returned
                end, unsent = end + len(line), unsent + 1
                event = _parse(line) or {}
                if event.get("op") == "start":
                    started.add(event.get("key"))
                elif event.get("op") == "artifact":
                    copies.add(event.get("copy"))
            if end < size:
                _LOG.warning("cut a torn last line (%d bytes) from %s", size - end, path)
                f.truncate(end)
        for stale in {p.name for p in self.artifacts.iterdir()} - copies:
            shutil.rmtree(self.artifacts / stale, ignore_errors=True)
        return lines, offset, unsent, started | set(self._runs)

    def append(self, event: dict[str, Any]) -> None:
        """Write one event line; fsync at most every ``flush_every_s``. Raises on a closed one."""
        data = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self.lock:
            if self.closed:
                raise RuntimeError(
                    f"this Tracker on {self.directory} is closed; log before close()"
                )
            try:
                view = memoryview(data)
                while view:
                    view = view[self._file.write(view) :]
            except OSError as exc:
                # Leave no torn line behind, or the next event would be glued onto it.
                with contextlib.suppress(OSError):
                    os.ftruncate(self._file.fileno(), self._size)
                _LOG.warning("could not journal a tracking event in %s: %s", self.directory, exc)
                return
            self._size += len(data)
            self.logged += 1
            if time.monotonic() - self._last_fsync >= self._flush_every_s:
                self._fsync()

    def _fsync(self) -> None:
        with contextlib.suppress(OSError):
            os.fsync(self._file.fileno())
        self._last_fsync = time.monotonic()

    def open_reader(self) -> Any:
        """A binary reader positioned at the first unacknowledged event (owned by the caller)."""
        reader = open(self.directory / JOURNAL_FILE, "rb")  # noqa: SIM115
        reader.seek(self.sent_offset)
        return reader

    def acknowledge(self, entries: list[_Entry]) -> bool:
        """Record ``entries`` as delivered. True when the journal was emptied (rewind readers)."""
        with self.lock:
            if self.closed:  # a later Tracker may own these files already; it replays the rest
                return False
            self.sent_lines += len(entries)
            self.sent_offset += sum(e.nbytes for e in entries)
            self.acked += len(entries)
            emptied = self.sent_offset >= _COMPACT_BYTES and self.acked == self.logged
            if emptied:  # truncate first: a crash before `sent` is written reads as "all sent"
                os.ftruncate(self._file.fileno(), 0)
                self._size, self.sent_lines, self.sent_offset = 0, 0, 0
            self._write(SENT_FILE, {"lines": self.sent_lines, "offset": self.sent_offset})
            self.lock.notify_all()
        for entry in entries:
            copy = self.copy_path(entry.event)
            if copy is not None:
                shutil.rmtree(copy.parent, ignore_errors=True)
        return emptied

    def copy_path(self, event: dict[str, Any]) -> Path | None:
        """The file or folder an ``artifact`` event's copy is, under ``artifacts/``; None for
        any other event, or one whose names would lead elsewhere (an altered journal): the
        journal never makes the tracker read or delete outside its folder."""
        copy, name = event.get("copy"), event.get("name")
        if event.get("op") != "artifact" or not isinstance(copy, str) or not isinstance(name, str):
            return None
        if not _COPY_NAME.fullmatch(copy) or name in ("", ".", "..") or "/" in name:
            _LOG.warning("journal event names an artifact outside %s; ignored", self.artifacts)
            return None
        return self.artifacts / copy / name

    def _write(self, name: str, obj: dict[str, Any]) -> None:
        """Replace a state file; a failure only costs a longer replay, so it is not raised."""
        try:
            write_json_atomic(self.directory / name, obj)
        except OSError as exc:
            _LOG.warning("could not write %s: %s", self.directory / name, _short(exc))

    def sync(self) -> None:
        """Fsync the journal now."""
        with self.lock:
            if not self.closed:
                self._fsync()

    def wait_acked(self, target: int, timeout: float) -> bool:
        """Wait until ``target`` events are acknowledged; False on timeout or once closed."""
        with self.lock:
            self.lock.wait_for(lambda: self.acked >= target or self.closed, timeout)
            return self.acked >= target

    def run_id(self, key: str) -> str | None:
        with self.lock:
            return self._runs.get(key)

    def set_run(self, key: str, run_id: str) -> None:
        with self.lock:
            if self.closed:
                return
            self._runs[key] = run_id
            self._write(RUNS_FILE, self._runs)

    def copy_artifact(self, path: Path) -> str:
        """Copy ``path`` (file or directory) under ``artifacts/<copy>/``; returns ``<copy>``.
        Symbolic links inside a directory are left out, never followed."""
        copy = uuid.uuid4().hex
        target = self.artifacts / copy / path.name
        target.parent.mkdir()
        try:
            if path.is_dir():
                shutil.copytree(path, target, ignore=_links)
            else:
                shutil.copy2(path, target)
        except BaseException:
            shutil.rmtree(target.parent, ignore_errors=True)
            raise
        return copy

    def close(self) -> None:
        """Fsync and stop writing; later acknowledgements from a lingering thread are dropped."""
        with self.lock:
            if self.closed:
                return
            self._fsync()
            self.closed = True
            self._file.close()
            self.lock.notify_all()
        os.close(self._lock_fd)  # releases the flock


def _links(folder: str, names: list[str]) -> list[str]:
    """The symbolic links among ``folder``'s ``names`` (for ``shutil.copytree``'s ``ignore``)."""
    return [name for name in names if os.path.islink(os.path.join(folder, name))]


def _lock_directory(directory: Path) -> int:
    """Hold an exclusive lock on ``directory`` for one Tracker at a time (released on exit)."""
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise PbtError(
            f"tracking journal {directory} is in use by another Tracker; give each process its "
            "own journal_dir, or close() the other one first"
        ) from None
    return fd


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _strings(values: dict[str, object] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (values or {}).items()}


def _now_ms() -> int:
    return int(time.time() * 1000)


def _short(exc: BaseException) -> str:
    """The first line of an error, capped: MLflow's connection errors run to pages."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _refused(exc: BaseException) -> bool:
    """True when retrying ``exc`` can't help: MLflow refused the request, or the event is bad.

    Unreachable stores, timeouts, locked databases and server errors are transient.
    """
    if isinstance(exc, OSError) or type(exc).__module__.startswith("sqlalchemy"):
        return False
    if type(exc).__module__.startswith("mlflow"):
        return getattr(exc, "error_code", None) in _REFUSED
    return True  # a malformed event or a bug: skipping it keeps the queue moving


def _read_into(reader: Any, buffer: deque[_Entry]) -> None:
    """Append the complete journal lines after ``reader``'s position to ``buffer``."""
    while len(buffer) < _READ_AHEAD:
        line = reader.readline()
        if not line.endswith(b"\n"):  # end of file, or a line still being written
            reader.seek(-len(line), os.SEEK_CUR)
            return
        buffer.append(_Entry(_parse(line) or {"op": "unreadable"}, len(line)))


def _take_batch(buffer: deque[_Entry]) -> list[_Entry]:
    """Pop the next unit to send: one event, or consecutive events of one run and kind that fit
    in one ``log_batch``."""
    batch = [buffer.popleft()]
    op, key = batch[0].event.get("op"), batch[0].event.get("key")
    if op not in _BATCH_LIMITS:
        return batch
    size = len(batch[0].event.get(op) or {})
    while buffer and buffer[0].event.get("op") == op and buffer[0].event.get("key") == key:
        more = len(buffer[0].event.get(op) or {})
        if size + more > _BATCH_LIMITS[op]:
            break
        batch.append(buffer.popleft())
        size += more
    return batch


def _items(op: str, event: dict[str, Any]) -> list[Any]:
    """The MLflow entities of one metrics, params or tags event."""
    from mlflow.entities import Metric, Param, RunTag

    if op == "metrics":
        return [Metric(k, v, event["t"], event["step"]) for k, v in event["metrics"].items()]
    entity = Param if op == "params" else RunTag
    return [entity(k, v) for k, v in event[op].items()]


class Tracker:
    """Logs runs, metrics, params, tags and artifacts to MLflow from one background thread.

    Every method returns at once; only programming errors (an unknown run key, a bad status, a
    metric that is not a number, logging after :meth:`close`) raise. Runs are addressed by the
    caller's stable keys (``"population"``, ``"g001-m00"``).

    Args:
        uri: The tracking URI: ``default_uri(run_dir)`` for the embedded store, or a server's
            ``http://host:port``.
        experiment: The experiment's name; created when missing.
        journal_dir: Where the journal lives (created); one Tracker at a time may use it.
        artifact_location: For a new experiment; by default ``<directory of the database>/
            mlartifacts`` for a SQLite store, else the server's default.
        flush_every_s: The journal is fsynced at most this often (and on flush and close).

    For an ``http(s)://`` uri, ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (10 s) and
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (0) are set in ``os.environ`` unless already set (child
    processes inherit them): the thread does its own retrying, and MLflow's defaults would hold
    it for minutes per attempt during an outage.

    Raises:
        PbtError: ``journal_dir`` is in use by another open Tracker.
    """

    def __init__(
        self,
        uri: str,
        experiment: str,
        journal_dir: Path | str,
        *,
        artifact_location: str | None = None,
        flush_every_s: float = 2.0,
    ) -> None:
        if not uri or not experiment:
            raise ValueError(f"uri ({uri!r}) and experiment ({experiment!r}) must be non-empty")
        if not flush_every_s > 0:
            raise ValueError(f"flush_every_s ({flush_every_s}) must be > 0")
        self.uri, self.experiment = uri, experiment
        self._artifact_location = artifact_location or _default_artifact_location(uri)
        self._journal = _Journal(Path(journal_dir), flush_every_s)
        self._known = set(self._journal.started)
        self.recovered = self._journal.logged
        """Events found unacknowledged in the journal when this Tracker opened it (sent first)."""
        self._experiment_id = ""
        self._down = False
        self._unmapped: set[str] = set()
        self._stop, self._wake = threading.Event(), threading.Event()
        if uri.startswith(("http://", "https://")):
            for name, value in _HTTP_ENV.items():
                os.environ.setdefault(name, value)
        self._thread = threading.Thread(target=self._send_loop, name="pbt-tracking", daemon=True)
        self._thread.start()

    # -- the caller's side: validate, journal, return ------------------------------------------

    def start_run(
        self,
        key: str,
        *,
        name: str,
        parent: str | None = None,
        tags: dict[str, str] | None = None,
        params: dict[str, object] | None = None,
    ) -> None:
        """Create the run for ``key``, or reuse (and mark running) the one created before.

        Args:
            key: The caller's stable id of the run.
            name: The run name shown in MLflow.
            parent: The key of the parent run, started before; sets ``mlflow.parentRunId``.
            tags: Tags to set.
            params: Params to log (write-once in MLflow: a changed value is skipped).
        """
        if parent is not None and parent not in self._known:
            raise ValueError(
                f"parent {parent!r} of run {key!r} is unknown; call start_run({parent!r}, ...) first"
            )
        self._known.add(key)
        event = {"op": "start", "key": key, "name": str(name), "parent": parent}
        self._log(event | {"tags": _strings(tags), "params": _strings(params), "t": _now_ms()})

    def log_metrics(self, key: str, metrics: dict[str, float], step: int) -> None:
        """Log ``metrics`` (NaN and inf included) at ``step``, timestamped now."""
        self._require(key)
        values = {}
        for name, value in metrics.items():
            try:
                values[str(name)] = float(value)
            except (TypeError, ValueError):
                raise TypeError(
                    f"metric {name!r} of run {key!r} must be a number, got {value!r}"
                ) from None
        self._log(
            {"op": "metrics", "key": key, "metrics": values, "step": int(step), "t": _now_ms()}
        )

    def set_tags(self, key: str, tags: dict[str, str]) -> None:
        """Set (or overwrite) tags of the run."""
        self._require(key)
        self._log({"op": "tags", "key": key, "tags": _strings(tags)})

    def log_params(self, key: str, params: dict[str, object]) -> None:
        """Log params; re-logging a value is harmless, changing one is skipped with a warning."""
        self._require(key)
        self._log({"op": "params", "key": key, "params": _strings(params)})

    def log_artifact(self, key: str, path: Path | str, artifact_path: str | None = None) -> None:
        """Log a file or directory as it is now: it is copied into the journal before returning.

        Args:
            key: The run's key.
            path: The file or directory; a directory keeps its name under ``artifact_path``.
            artifact_path: The folder inside the run's artifacts; the root by default.
        """
        self._require(key)
        if Path(path).is_symlink():  # a checkpoint's adapter, say: never followed out
            _LOG.warning("artifact %s of run %r not logged: it is a symbolic link", path, key)
            return
        path = Path(path).resolve()
        try:
            copy = self._journal.copy_artifact(path)
        except OSError as exc:
            _LOG.warning("artifact %s of run %r not logged: %s", path, key, _short(exc))
            return
        event = {"op": "artifact", "key": key, "copy": copy, "name": path.name}
        self._log(event | {"artifact_path": artifact_path})

    def end_run(self, key: str, status: str = "FINISHED") -> None:
        """Mark the run ended with ``status`` (FINISHED, FAILED or KILLED)."""
        self._require(key)
        if status not in END_STATUSES:
            raise ValueError(f"end_run status ({status!r}) must be one of {END_STATUSES}")
        self._log({"op": "end", "key": key, "status": status, "t": _now_ms()})

    def has_run(self, key: str) -> bool:
        """True once ``start_run(key)`` was called on this journal, by this Tracker or by one
        before it (the run may not be created in MLflow yet, but it will be)."""
        return key in self._known

    def run_id(self, key: str) -> str | None:
        """The MLflow run id of ``key`` once the run is created, else None."""
        return self._journal.run_id(key)

    @property
    def pending(self) -> int:
        """Events logged but not yet acknowledged by MLflow."""
        return self._journal.logged - self._journal.acked

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far is in MLflow.

        Returns:
            True if it all arrived within ``timeout`` seconds (None: no limit).
        """
        target = self._journal.logged
        self._journal.sync()
        self._wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # in slices, to notice a thread that is gone
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if self._journal.wait_acked(target, max(left, 0.0)):
                return True
            if not self._thread.is_alive() or (deadline is not None and left <= 0):
                return False

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flush, then stop the thread; what was not sent stays in the journal for the next one.

        Returns:
            True if everything logged arrived within ``timeout`` seconds.
        """
        if self._journal.closed:
            return self.pending == 0
        began = time.monotonic()
        delivered = self.flush(timeout)
        self._stop.set()
        self._wake.set()
        self._thread.join(
            None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
        )
        self._journal.close()
        if not delivered:
            _LOG.warning(
                "%d tracking events not yet in MLflow stay in %s for the next Tracker",
                self.pending, self._journal.directory,
            )  # fmt: skip
        return delivered

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _require(self, key: str) -> None:
        if key not in self._known:
            raise ValueError(f"run key {key!r} is unknown; call start_run({key!r}, ...) first")

    def _log(self, event: dict[str, Any]) -> None:
        self._journal.append(event)
        self._wake.set()

    # -- the thread's side: read the journal in order, send, acknowledge ---------------------

    def _send_loop(self) -> None:
        try:
            client = self._retry(self._connect, f"experiment {self.experiment!r}")
            if client is None:
                _LOG.error("tracking stopped; events stay in %s", self._journal.directory)
            if client is None or client is _STOPPED:
                return
            with self._journal.open_reader() as reader:
                self._pump(client, reader)
        except Exception:
            _LOG.exception("tracking thread failed; events stay in %s", self._journal.directory)

    def _pump(self, client: Any, reader: Any) -> None:
        buffer: deque[_Entry] = deque()
        while not self._stop.is_set():
            self._wake.clear()
            _read_into(reader, buffer)
            if not buffer:
                self._wake.wait()
                continue
            batch = _take_batch(buffer)
            what = f"{batch[0].event.get('op')} of run {batch[0].event.get('key')!r}"
            if self._retry(functools.partial(self._apply, client, batch), what) is _STOPPED:
                return
            if self._journal.acknowledge(batch):
                reader.seek(0)

    def _retry(self, action: Callable[[], Any], what: str) -> Any:
        """Run ``action`` until it succeeds (its result), is refused (None) or we stop (_STOPPED)."""
        delay = _FIRST_BACKOFF_S
        while not self._stop.is_set():
            try:
                result = action()
            except Exception as exc:
                if _refused(exc):
                    self._set_down(False, exc)
                    _LOG.warning("MLflow refused %s, skipped: %s", what, _short(exc))
                    return None
                self._set_down(True, exc)
                self._stop.wait(delay)
                delay = min(2 * delay, MAX_BACKOFF_S)
            else:
                self._set_down(False)
                return result
        return _STOPPED

    def _set_down(self, down: bool, exc: BaseException | None = None) -> None:
        """Warn once when the store becomes unreachable and once when it is back."""
        if down == self._down:
            return
        self._down = down
        if down:
            _LOG.warning(
                "MLflow at %s unreachable (%s); events wait in %s and are retried",
                self.uri, _short(exc) if exc else "", self._journal.directory,
            )  # fmt: skip
        else:
            _LOG.warning("MLflow at %s reachable again; sending %d events", self.uri, self.pending)

    def _connect(self) -> Any:
        """An ``MlflowClient`` on ``uri`` with the experiment in place (the one mlflow import)."""
        import mlflow
        from mlflow.exceptions import MlflowException

        for name in ("mlflow", "alembic"):  # store creation chatters at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        _create_sqlite_store(self.uri, self._artifact_location)
        client = mlflow.MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            try:
                self._experiment_id = client.create_experiment(
                    self.experiment, artifact_location=self._artifact_location
                )
            except MlflowException as exc:  # another process created it first
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                self._experiment_id = client.get_experiment_by_name(self.experiment).experiment_id
        else:
            self._experiment_id = found.experiment_id
            if found.lifecycle_stage == "deleted":
                _LOG.warning("restoring deleted MLflow experiment %r", self.experiment)
                client.restore_experiment(found.experiment_id)
        return client

    def _apply(self, client: Any, batch: list[_Entry]) -> None:
        """Send one unit from :func:`_take_batch`; raises what MLflow raised."""
        event = batch[0].event
        op, key = event.get("op"), event.get("key")
        run_id = self._journal.run_id(key) if isinstance(key, str) else None
        if op == "start":
            self._start(client, event)
        elif run_id is None:
            if key not in self._unmapped:
                self._unmapped.add(key)
                _LOG.warning("no MLflow run for %r (start refused?); its %s are skipped", key, op)
        elif op in _BATCH_LIMITS:
            items = [item for entry in batch for item in _items(op, entry.event)]
            self._log_batch(client, run_id, key, op, items)
        elif op == "end":
            client.set_terminated(run_id, event["status"], end_time=event["t"])
        elif op == "artifact":
            local = self._journal.copy_path(event)
            if local is None:
                raise ValueError(f"journal event {event} names no copy in the journal's folder")
            if not local.exists():  # not OSError: retrying can't bring it back
                raise ValueError(f"the journal's copy {local} is gone")
            client.log_artifact(run_id, str(local), event["artifact_path"])
        else:
            raise ValueError(f"unreadable journal event {event}")

    def _start(self, client: Any, event: dict[str, Any]) -> None:
        key, parent = event["key"], event["parent"]
        run_id = self._journal.run_id(key)
        if run_id is None:
            tags = {}
            if parent is not None and (parent_id := self._journal.run_id(parent)) is not None:
                tags["mlflow.parentRunId"] = parent_id
            run = client.create_run(
                self._experiment_id, start_time=event["t"], tags=tags, run_name=event["name"]
            )
            run_id = run.info.run_id
            self._journal.set_run(key, run_id)
        else:
            client.update_run(run_id, status="RUNNING")
        for op in ("tags", "params"):
            self._log_batch(client, run_id, key, op, _items(op, event))

    def _log_batch(self, client: Any, run_id: str, key: str, op: str, items: list[Any]) -> None:
        """``log_batch`` in chunks; a refused chunk is resent item by item to skip only the bad."""
        limit = _BATCH_LIMITS[op]
        for chunk in (items[i : i + limit] for i in range(0, len(items), limit)):
            try:
                client.log_batch(run_id, **{op: chunk})
            except Exception as exc:
                if not _refused(exc):
                    raise
                self._log_one_by_one(client, run_id, key, op, chunk)

    def _log_one_by_one(
        self, client: Any, run_id: str, key: str, op: str, items: Iterable[Any]
    ) -> None:
        for item in items:
            try:
                client.log_batch(run_id, **{op: [item]})
            except Exception as exc:
                if not _refused(exc):
                    raise
                _LOG.warning(
                    "MLflow refused %s %r of run %r, skipped: %s", op, item.key, key, _short(exc)
                )
