"""Long-lived workers: one group per slot that loads the base model once and takes task after
task from its inbox (the worker's side is :mod:`pbt.worker.serve`), on any backend (a worker is
a local process group or a Slurm job). No torch here."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pbt.launch.attempt import Outcome, Running, TaskSpec
from pbt.launch.local import LocalLauncher, classify_fault
from pbt.launch.processes import KILL_GRACE_S, ProcessGroup, describe_exit, log_tail
from pbt.protocol.files import RELEASED, write_json_atomic
from pbt.protocol.messages import RESULT_FILE, MessageError, ResultMessage


@dataclass
class _Worker:
    slot: int
    nproc: int
    port: int
    proc: ProcessGroup
    folder: Path
    sent: int = 0
    """Inbox entries written to this worker so far (the next one's number)."""


class PersistentLauncher(LocalLauncher):
    """Run tasks on long-lived worker groups, one per slot, that load the base model once.

    The same ``run`` contract and task files as :class:`LocalLauncher`, plus one folder per
    slot, ``<workers_dir>/slot<i>``: the controller starts the group there with ``--serve
    FOLDER`` in place of a task path, and hands it each task by writing
    ``inbox/<n>.json`` (``{"task": .../task.json, "log": ...}``, ``n`` = 0, 1, ... for each
    worker start). The worker takes the entries in order, runs each as the one-shot worker
    would (heartbeat and ``result.json`` in the task's folder, its output in the task's log) and
    waits for the next. Once a task's state is in host memory the worker marks it ``released``
    and writes its checkpoint in the background: the slot then takes its next task at once, so
    the write overlaps the next member's training, and the released task ends when its result
    arrives. A task that fails, hangs or outruns its timeout takes its worker down with it
    (a released one still writing, too): the group is killed and a fresh one serves the slot's
    next task. ``close()`` (or a
    ``stop`` file) ends the workers; a worker also ends after ``idle_timeout_s`` without a task
    and when its folder is gone. A worker is a group of the launcher's ``backend``: on Slurm,
    one long-running job per slot.

    Args:
        command: as :class:`LocalLauncher`'s, for a program that serves (``pbt.worker``).
        workers_dir: where the slot folders go (a campaign's ``workers/``).
        idle_timeout_s: passed to the workers.
        members_per_batch: tasks a worker runs together (``launch.members_per_batch``): a slot
            is handed that many and as many again behind them, so the next batch is in the
            inbox when the worker takes it.
        **kwargs: as :class:`LocalLauncher`; ``poll_s`` defaults to 0.01 here (unless the
            backend asks for its own), since a task's end is the next one's start on the same
            worker, and every check waited is idle.
    """

    default_poll_s = 0.01

    def __init__(
        self,
        command: list[str],
        workers_dir: Path,
        idle_timeout_s: float = 900.0,
        members_per_batch: int = 1,
        **kwargs,
    ) -> None:
        super().__init__(command, **kwargs)
        self.workers_dir = Path(workers_dir)
        self.idle_timeout_s = idle_timeout_s
        self.ahead = 2 * members_per_batch - 1
        self.takes_together = members_per_batch
        self._workers: dict[int, _Worker] = {}
        for slot in range(self.slots):  # groups a crashed controller left behind
            self.backend.end_orphan_worker(self._folder(slot))

    ahead = 1

    def _queues(self, slot: int, task: TaskSpec) -> bool:
        worker = self._workers.get(slot)
        return worker is not None and worker.proc.poll() is None and worker.nproc == task.nproc

    def _folder(self, slot: int) -> Path:
        return self.workers_dir / f"slot{slot}"

    def _launch(self, index: int, task: TaskSpec, slot: int, taken_ports: set[int]) -> Running:
        """Hand the task to the slot's worker, started first if there is none (or it cannot
        take the task)."""
        task_dir = Path(task.task_dir)
        worker = self._workers.get(slot)
        if worker is not None and (worker.proc.poll() is not None or worker.nproc != task.nproc):
            self.backend.stop([worker.proc])
            worker = None
        if worker is None:
            worker = self._spawn(slot, task.nproc, taken_ports)
        Path(task.log_path).parent.mkdir(parents=True, exist_ok=True)
        entry = {"task": str(task_dir / "task.json"), "log": str(task.log_path)}
        # not flushed to the disk: a worker outlives no crash of this controller, and the
        # flush would delay every hand-over
        write_json_atomic(worker.folder / "inbox" / f"{worker.sent:06d}.json", entry, durable=False)
        worker.sent += 1
        return Running(index, task, slot, worker.port, worker.proc, time.monotonic(), time.time())

    def _spawn(self, slot: int, nproc: int, taken_ports: set[int]) -> _Worker:
        """Start a worker group for ``slot`` on an empty inbox."""
        folder = self._folder(slot)
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "inbox").mkdir(parents=True)
        port = self._pick_port(slot, taken_ports | {w.port for w in self._workers.values()})
        tail = ["--serve", str(folder), "--idle-timeout", f"{self.idle_timeout_s:g}"]
        proc = self._popen(slot, nproc, port, tail, folder / "worker.log")
        self.backend.record(proc, folder)
        worker = _Worker(slot, nproc, port, proc, folder)
        self._workers[slot] = worker
        return worker

    def _released(self, item: Running) -> bool:
        return (Path(item.task.task_dir) / RELEASED).exists()

    def _check(self, item: Running) -> Outcome | None:
        path = Path(item.task.task_dir) / RESULT_FILE
        if path.exists():  # written atomically: complete once it exists
            try:
                result = ResultMessage.read(path)
            except MessageError as err:
                returncode = self._drop(item)
                return self._outcome(item, returncode, "bad_result", None, str(err))
            if result is not None:
                return self._outcome(item, 0, "ok", result, "served by a long-lived worker")
            returncode = self._drop(item)
            return self._outcome(
                item, returncode, "bad_result", None, "result.json is not a JSON object"
            )
        returncode = item.proc.poll()
        if returncode is not None:  # the worker ended before the task did
            self._drop(item)
            if returncode == 0:
                return self._outcome(
                    item, 0, "no_result", None, "the worker exited 0 without finishing the task"
                )
            log = self._folder(item.slot) / "worker.log"
            status, detail = classify_fault(item.task, describe_exit(returncode), log)
            outcome = self._outcome(item, returncode, status, None, detail)
            return self.backend.explain(item.proc, outcome)
        overdue = self._overdue(item)
        if overdue is None:
            return None
        status, reason = overdue
        returncode = self._drop(item)
        return self._outcome(
            item, returncode, status, None, f"{reason}; the worker was {describe_exit(returncode)}"
        )

    def _drop(self, item: Running) -> int:
        """Kill the worker that ran ``item`` (and its group); the slot starts a fresh one."""
        (returncode,) = self.backend.stop([item.proc])
        worker = self._workers.get(item.slot)
        if worker is not None and worker.proc is item.proc:
            del self._workers[item.slot]
        return returncode

    def _outcome(self, item, returncode, status, result, detail) -> Outcome:
        outcome = super()._outcome(item, returncode, status, result, detail)
        if status == "ok":
            return outcome
        worker_log = self._folder(item.slot) / "worker.log"
        tail = log_tail(worker_log)
        if tail:
            detail = f"{outcome.detail}\n--- last lines of the worker's own log ---\n{tail}"
            outcome = dataclasses.replace(outcome, detail=detail)
        _keep_worker_log(worker_log, Path(item.task.log_path))
        return outcome

    def _discard(self, item: Running) -> None:
        self._drop(item)

    def close(self) -> None:
        """Ask every worker to stop, and kill those that have not within the grace period (at
        once, one that was handed a task ahead that will not run)."""
        for item in self.hand_ahead.running():
            self._discard(item)
        self.hand_ahead.clear()
        for worker in self._workers.values():
            with contextlib.suppress(OSError):
                (worker.folder / "stop").touch()
        deadline = time.monotonic() + KILL_GRACE_S
        for worker in self._workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
        self.backend.stop([w.proc for w in self._workers.values()])
        self._workers.clear()


def _keep_worker_log(worker_log: Path, task_log: Path) -> None:
    """Append the last lines of a failed long-lived worker's own log to its task's log when
    only the worker's tells why (it failed before taking the task, or outside it) or the
    task's holds nothing: the task's log is the one a fault names, and the worker's is
    replaced when the slot's next worker starts."""
    if not log_tail(worker_log):
        return
    if log_tail(task_log) and (_failure_in(task_log) or not _failure_in(worker_log)):
        return
    with contextlib.suppress(OSError), open(task_log, "a", encoding="utf-8") as log:
        log.write(f"\n--- last lines of {worker_log}, where the worker failed ---\n")
        log.write(log_tail(worker_log, 200) + "\n")


def _failure_in(log: Path) -> bool:
    """Whether ``log`` ends in a failure's account: a traceback or an ``error:`` line."""
    tail = log_tail(log, 200)
    return "Traceback (most recent call last)" in tail or "\nerror:" in f"\n{tail}"
