"""The long-lived worker: tasks handed to its inbox, run one after another on one model loaded
once, each checkpoint written in the background while the next task trains.

    torchrun --nproc_per_node=N -m pbt.worker --serve <slot_folder>

The launcher's side of the same folder is :class:`pbt.launch.persistent.PersistentLauncher`; one task
is :mod:`pbt.worker.task`; the states this worker keeps for its members' children are
:mod:`pbt.worker.cache`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pbt.protocol import faults
from pbt.protocol.files import RELEASED, Heartbeat, read_json
from pbt.protocol.messages import RESULT_FILE, ResultMessage, TaskMessage
from pbt.worker import batch, cache
from pbt.worker.task import Served, failed, finish_task, read_task, start_task


def serve(folder: Path, idle_timeout_s: float = 900.0, poll_s: float = 0.005) -> int:
    """Run the tasks handed to ``folder/inbox`` in order, on one model loaded once.

    Every rank reads the same inbox, so the group agrees on each task without a collective
    while it waits. Once a task's state is snapshotted to host memory, rank 0 marks the task
    ``released`` (the launcher may hand over the next one) and writes the checkpoint, then
    ``result.json``, from a background thread while the next task trains; the task heartbeats
    until its result is written. With ``launch.members_per_batch`` > 1 the tasks handed
    together run as one population batch (:mod:`pbt.worker.batch`), each released and written
    as above. At most one task's (or one batch's) writes are in flight. When the next task is
    already handed over, the write starts once that task has loaded its member: the write's
    first steps (settling the copies, pickling) hold the interpreter, and would slow the switch of
    member, which nothing overlaps. Ends on a ``stop`` file, when the folder is gone, or after
    ``idle_timeout_s`` without a task, in each case after the write in flight. A task that
    fails ends the worker (exit 2), since its ranks may be out of step; so does a failed write
    (the task in training then fails with it, and is retried). Each rank also ends (exit 3, at
    once) within a second or two of its controller's death
    (:func:`pbt.protocol.controller.watch_controller`, started by :func:`pbt.worker.main.main`).
    """
    from pbt.distributed import shutdown

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    host, taken, writing = None, 0, []
    ahead = cache.ParentAhead(folder) if world_size == 1 else None
    try:
        while True:
            if writing and not (folder / "inbox" / f"{taken:06d}.json").exists():
                for writer in writing:  # no task waits to load a member: nothing to slow
                    writer.go()
            entry = next_entry(folder, taken, idle_timeout_s, poll_s)
            if entry is None:
                return 0
            taken += 1
            task_path = Path(entry["task"])
            task = read_task(task_path)
            if task is None:
                return 2
            size = batch.batch_size(task, world_size)
            if size > 1:
                more = batch.gather(folder, taken, task, size)
                taken += len(more)
                code, host, writing = _serve_batch([entry, *more], host, writing, rank)
                if ahead is not None:
                    ahead.number = taken
                if code:
                    return code
                continue
            if ahead is not None:
                ahead.number = taken  # the entry after this one
            beat = Heartbeat(task_path.parent / "heartbeat") if rank == 0 else None
            last = writing[-1] if writing else None
            with contextlib.ExitStack() as stack:
                if beat is not None:
                    stack.enter_context(beat)
                with _output_to([entry["log"]], rank == 0):
                    try:
                        served = Served(
                            ahead,
                            loaded=functools.partial(_go_all, writing) if writing else None,
                            writing=last.write if last is not None else None,
                        )
                        result, host, write = start_task(task, host, beat, served)
                    except BaseException as err:
                        if not failed(task_path.parent, err):
                            raise
                        return 2
                if rank == 0:
                    _finish_all(writing)
                    # the write owns the heartbeat from here on, till the result is written
                    writing = [
                        _Writer(task_path.parent, entry["log"], result, write, stack.pop_all())
                    ]
    finally:
        _finish_all(writing)
        shutdown()


def _go_all(writing: list[_Writer]) -> None:
    for writer in writing:
        writer.go()


def _finish_all(writing: list[_Writer]) -> None:
    for writer in writing:
        writer.finish()


def _serve_batch(
    entries: list[dict[str, Any]], host: Any, writing: list[_Writer], rank: int
) -> tuple[int, Any, list[_Writer]]:
    """Run the tasks of ``entries`` as one population batch (:mod:`pbt.worker.batch`): each
    task heartbeats, logs and ends as alone. Returns the exit code to end the worker with (0:
    go on; 2: a task failed, after the others' writes), the host and the writes started."""
    dirs = [Path(e["task"]).parent for e in entries]
    tasks = [TaskMessage.read(Path(e["task"])) for e in entries]
    with contextlib.ExitStack() as stacks:
        beats = [Heartbeat(d / "heartbeat") if rank == 0 else None for d in dirs]
        held = []
        for beat in beats:
            stack = stacks.enter_context(contextlib.ExitStack())
            if beat is not None:
                stack.enter_context(beat)
            held.append(stack)
        with _output_to([e["log"] for e in entries], rank == 0):
            try:
                ran, host = batch.start_batch(
                    tasks,
                    host,
                    beats,
                    [w.write for w in writing],
                    loaded=functools.partial(_go_all, writing),
                )
            except BaseException as err:
                expected = [failed(d, err) for d in dirs]
                if not all(expected):
                    raise
                return 2, host, writing
        _finish_all(writing)
        code, started = 0, []
        for run, entry, directory, stack in zip(ran, entries, dirs, held, strict=True):
            if run.error is not None:
                with _output_to([entry["log"]], rank == 0):
                    if not failed(directory, run.error):
                        raise run.error
                code = 2
            elif rank == 0:
                started.append(
                    _Writer(directory, entry["log"], run.result, run.write, stack.pop_all())
                )
        if code:
            _finish_all(started)
        return code, host, started


class _Writer(threading.Thread):
    """Writes a served task's checkpoint, then its ``result.json``, in the background, and
    keeps its state in the worker's cache; on failure reports the fault
    (:mod:`pbt.protocol.faults`) and ends the worker with exit 2."""

    def __init__(
        self,
        task_dir: Path,
        log: str,
        result: ResultMessage,
        write: Any,
        heartbeat: contextlib.ExitStack,
    ) -> None:
        super().__init__(name="pbt-checkpoint-writer", daemon=True)
        self.task_dir, self.log, self.result = task_dir, log, result
        self.write, self.heartbeat = write, heartbeat
        # the result but the checkpoint's digest: the controller may choose the next generation
        # from it while the write runs (the task ends when result.json arrives)
        result.write(task_dir / RELEASED, durable=False)

    def go(self) -> None:
        """Start the write (once)."""
        if self.ident is None:
            self.start()

    def finish(self) -> None:
        """Start the write if it has not started, and wait for its end."""
        self.go()
        self.join()

    def run(self) -> None:
        try:
            with self.heartbeat:
                result = finish_task(self.result, self.write)
                snapshot = self.write
                if snapshot is not None and snapshot.cache_as is not None and result.digest:
                    cache.STATES.put(
                        snapshot.cache_as,
                        result.digest,
                        snapshot.attributes,
                        snapshot.nbytes(),
                        on_device=snapshot.on_device,
                    )
                if snapshot is not None:
                    snapshot.on_device = None  # kept by the cache alone, if at all
                result.write(self.task_dir / RESULT_FILE)
        except BaseException as err:
            kind = faults.report(self.task_dir, err, exit_code=2)
            with contextlib.suppress(OSError), open(self.log, "a") as f:
                traceback.print_exc(file=f)
                what = kind.replace("_", " ") if kind else "writing the checkpoint failed"
                print(f"error: {what}: {err}", file=f)
            os._exit(2)


def next_entry(
    folder: Path, number: int, idle_timeout_s: float, poll_s: float
) -> dict[str, Any] | None:
    """Wait for inbox entry ``number`` (``{"task": path, "log": path}``); None when the worker
    should stop."""
    path = folder / "inbox" / f"{number:06d}.json"
    deadline = time.monotonic() + idle_timeout_s
    while time.monotonic() < deadline:
        if (folder / "stop").exists() or not folder.is_dir():
            return None
        entry = read_json(path)
        if entry is not None:
            return entry
        time.sleep(poll_s)
    return None


@contextlib.contextmanager
def _output_to(logs: list[str], enabled: bool) -> Iterator[None]:
    """This rank's prints go to the logs of the tasks it runs while they run (each line to
    every one of them, for a batch)."""
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(log, "a", buffering=1)) for log in logs]
        out = files[0] if len(files) == 1 else _Tee(files)
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(out))
        yield


class _Tee:
    """A text stream writing to several files."""

    def __init__(self, files: list[Any]) -> None:
        self.files = files

    def write(self, text: str) -> int:
        for f in self.files:
            f.write(text)
        return len(text)

    def flush(self) -> None:
        for f in self.files:
            f.flush()
