"""Run member tasks as process groups and read back what they report: no torch here.

The protocol, all JSON files in one task directory, all written atomically:

- the controller writes ``task.json`` (a :class:`~pbt.protocol.messages.TaskMessage`); the
  member gets its path as its last argument;
- the member touches ``heartbeat`` every few seconds while alive (:class:`Heartbeat`); the
  launcher reads only its modification time, the controller's display its content, the
  member's progress (:mod:`pbt.protocol.progress`);
- on success the member writes ``result.json`` (a :class:`~pbt.protocol.messages.ResultMessage`);
  a file that is not one of this version is a ``bad_result``, with the reason.

:class:`LocalLauncher` runs each task attempt (a ``torchrun`` command, in practice) as a process
group of its own, started by its backend (:mod:`pbt.launch.backend`): on this machine by
default, in its own session so the whole tree can be killed with one ``os.killpg``, or as a
Slurm job (:class:`~pbt.launch.slurm.SlurmBackend`). A task gets a slot (its GPUs), and the rest
queue. The default command lets torchrun bind its rendezvous port itself (``--standalone``:
port 0, read back by its ranks), so no other process can take the port between its choice and
its bind; a command of the caller's that names ``{port}`` gets one that was free when chosen.
Every local process of a task carries the campaign and the controller in its environment
(:mod:`pbt.protocol.controller`): a long-lived worker ends soon after its controller dies, and
a resumed controller ends whatever its predecessor left running.

A member that fails for want of memory or disk, because its training diverged, because a
reward function failed, or on a configuration error, says so in ``fault.json`` (:mod:`pbt.protocol.faults`); its outcome is then
``out_of_memory``, ``disk_full``, ``diverged``, ``reward_error`` or ``config_error`` rather than ``failed``. Any
failed member's outcome starts with the cause its worker reported and the worker's own exit code
(torchrun's agent exits 1 whatever its worker's code; without a report, the code is read from
the agent's summary in the log). The task's log holds the failure's account: a long-lived
worker that failed outside its task (before taking it, say) leaves it in its own log, whose
last lines are copied into the task's. With a memory limit, every process of a member's group
starts under ``RLIMIT_DATA``.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable
from pathlib import Path

from pbt.config.errors import PbtError
from pbt.launch.attempt import Outcome, OutcomeStatus, Running, TaskSpec
from pbt.launch.backend import GroupSpec, LocalBackend, ProcessBackend
from pbt.launch.backend import member_command as member_command
from pbt.launch.handahead import HandAhead
from pbt.launch.processes import ProcessGroup, describe_exit, log_tail, port_is_free
from pbt.protocol import faults
from pbt.protocol.crash import crash_point
from pbt.protocol.files import RELEASED
from pbt.protocol.messages import (
    RESULT_FILE,
    MessageError,
    ResultMessage,
)

_AGENT_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
"""The worker's exit code in torchrun's failure summary (its first observed failure first)."""

STALE_FILES = (RESULT_FILE, "heartbeat", faults.FAULT_FILE, RELEASED)
"""A task's files from a previous attempt, removed before the next one starts."""


class LocalLauncher:
    """Run each task attempt as a process group of its own, at most ``slots`` at once, in FIFO
    order, on this machine or as Slurm jobs (its ``backend``).

    Args:
        command: program prefix; ``{nproc}`` and ``{port}`` are replaced per task, and the path
            of ``task.json`` is appended.
        slots: tasks run at once.
        gpus_per_member: GPUs per slot; 0 runs members on the CPU (``CUDA_VISIBLE_DEVICES=""``).
        gpu_ids: GPUs to split into slots; default ``0 ..`` as many as the slots need.
        members_per_gpu: slots sharing each GPU group: slots ``0 .. k-1`` get the first
            ``gpus_per_member`` GPUs, the next ``k`` the next ones.
        heartbeat_timeout_s: a task whose heartbeat is older than this (or missing this long
            after start) is killed.
        task_timeout_s: a task running longer than this is killed; None: no limit.
        poll_s: seconds between checks of the running tasks; default :attr:`default_poll_s`,
            or what the backend asks for.
        base_port: for a command that names ``{port}``: slot ``i`` gets port ``base_port + 10 *
            i`` (or the next free one). The default command needs none (``--standalone``).
        env: variables added to the inherited environment.
        campaign_dir: the campaign the tasks belong to, named in every process's environment
            (``PBT_CAMPAIGN``), so that a resumed controller finds what is left of them.
        hand_ahead: where the tasks handed ahead to long-lived workers are kept from one
            :meth:`run` to the next (the campaign's; a new one by default).
        memory_limit_bytes: the most memory each process of a task may allocate
            (``RLIMIT_DATA``: its heap and private mappings; not GPU memory, not the address
            space CUDA reserves); past it an allocation fails and the member reports
            ``out_of_memory``. None: no limit.
        backend: what starts, watches and stops the groups (:mod:`pbt.launch.backend`);
            default: :class:`~pbt.launch.backend.LocalBackend`, this machine.
    """

    default_poll_s = 0.5

    def __init__(
        self,
        command: list[str],
        slots: int,
        gpus_per_member: int = 0,
        gpu_ids: list[int] | None = None,
        heartbeat_timeout_s: float = 120.0,
        task_timeout_s: float | None = None,
        poll_s: float | None = None,
        base_port: int = 29600,
        env: dict[str, str] | None = None,
        memory_limit_bytes: int | None = None,
        members_per_gpu: int = 1,
        campaign_dir: Path | None = None,
        hand_ahead: HandAhead | None = None,
        backend: ProcessBackend | None = None,
    ) -> None:
        self.backend = LocalBackend() if backend is None else backend
        if poll_s is None:
            own = self.backend.poll_s
            poll_s = self.default_poll_s if own is None else own
        groups = -(-slots // max(1, members_per_gpu))
        ids = list(range(groups * gpus_per_member)) if gpu_ids is None else list(gpu_ids)
        positive = {"slots": slots, "heartbeat_timeout_s": heartbeat_timeout_s, "poll_s": poll_s}
        positive["task_timeout_s"] = 1 if task_timeout_s is None else task_timeout_s
        problems = [f"{key} ({value}) must be > 0" for key, value in positive.items() if value <= 0]
        if not command:
            problems.append("command is empty; give the program to run, e.g. torchrun's argv")
        if memory_limit_bytes is not None and memory_limit_bytes <= 0:
            problems.append(f"memory_limit_bytes ({memory_limit_bytes}) must be > 0 or None")
        if members_per_gpu < 1:
            problems.append(f"members_per_gpu ({members_per_gpu}) must be >= 1")
        if gpus_per_member < 0:
            problems.append(f"gpus_per_member ({gpus_per_member}) must be >= 0")
        elif len(set(ids)) != len(ids) or len(ids) < groups * gpus_per_member:
            problems.append(
                f"gpu_ids ({ids}) must be ceil(slots ({slots}) / members_per_gpu "
                f"({members_per_gpu})) x gpus_per_member ({gpus_per_member}) distinct GPUs or "
                "more; lower slots or list more GPUs"
            )
        if problems:
            raise ValueError("LocalLauncher: " + "; ".join(problems))
        self.command, self.slots, self.gpus_per_member = list(command), slots, gpus_per_member
        self.heartbeat_timeout_s, self.task_timeout_s = heartbeat_timeout_s, task_timeout_s
        self.poll_s, self.base_port, self.env = poll_s, base_port, dict(env or {})
        self.memory_limit_bytes = memory_limit_bytes
        self.campaign_dir = None if campaign_dir is None else Path(campaign_dir).resolve()
        self.started: dict[str, str] = {}
        """Task id -> the process group id (or job id) that runs its latest attempt."""
        self.hand_ahead = HandAhead() if hand_ahead is None else hand_ahead
        """Tasks of the next :meth:`run` handed to workers ahead (:mod:`pbt.launch.handahead`)."""
        self.slot_gpus = [
            ",".join(str(g) for g in ids[j * gpus_per_member : (j + 1) * gpus_per_member])
            for j in (i // max(1, members_per_gpu) for i in range(slots))
        ]
        """``CUDA_VISIBLE_DEVICES`` of each slot ("" on CPU)."""

    def run(
        self,
        tasks: list[TaskSpec],
        on_start: Callable[[TaskSpec, int], object] | None = None,
        on_done: Callable[[Outcome], object] | None = None,
        on_poll: Callable[[list[TaskSpec], list[TaskSpec]], object] | None = None,
        on_released: Callable[[dict[str, ResultMessage]], list[TaskSpec]] | None = None,
    ) -> list[Outcome]:
        """Run every task and return their outcomes in the order of ``tasks``.

        ``on_start(task, slot)`` and ``on_done(outcome)`` are called from this thread as tasks
        start and end, ``on_poll(running, queued)`` after each check of the running tasks
        (every ``poll_s``), where progress is shown. On any exception (KeyboardInterrupt
        included) every running process group is killed before it propagates.

        ``on_released(results)`` is called once, when every task has ended ok or been released
        by its long-lived worker with its result (its checkpoint still being written):
        ``results`` maps each task id to its result, the released ones' without a digest. It
        returns tasks of the *next* call (their ``task.json`` written), which idle workers start
        at once, behind the writes: the next call keeps each one whose ``TaskSpec`` and
        ``task.json`` it is given unchanged, and ends the worker of any other (it was a guess
        that did not hold). A generation's last checkpoint write then overlaps the next
        generation's first members instead of holding up the device.
        """
        self._check_tasks(tasks)
        holding: list[list[Running]] = [[] for _ in range(self.slots)]
        """Each slot's tasks not yet released, in the order its worker takes them."""
        running: list[Running] = []
        outcomes: dict[int, Outcome] = {}
        adopted = self.hand_ahead.adopt(tasks, self._discard)
        for item in adopted:
            holding[item.slot].append(item)
            running.append(item)
            self.started[item.task.task_id] = str(item.proc.pid)
            if on_start is not None:
                on_start(item.task, item.slot)
        kept = {item.index for item in adopted}
        queue = collections.deque((i, t) for i, t in enumerate(tasks) if i not in kept)
        try:
            while queue or running:
                while queue and (slot := self._next_slot(holding, queue[0][1])) is not None:
                    index, task = queue.popleft()
                    item = self._start(index, task, slot, {r.port for r in running})
                    item.behind = holding[slot][-1] if holding[slot] else None
                    holding[slot].append(item)
                    running.append(item)
                    self.started[task.task_id] = str(item.proc.pid)
                    if on_start is not None:
                        on_start(task, slot)
                for item in list(running):
                    if self._lost(item):
                        # handed ahead to a worker that ended before taking it: not an attempt
                        running.remove(item)
                        holding[item.slot].remove(item)
                        queue.appendleft((item.index, item.task))
                        continue
                    outcome = self._check(item)
                    if outcome is None:
                        if not item.released and self._released(item):
                            item.released = True
                            holding[item.slot].remove(item)
                        continue
                    running.remove(item)
                    item.ended = True
                    if not item.released:
                        holding[item.slot].remove(item)
                    outcomes[item.index] = outcome
                    if on_done is not None:
                        on_done(outcome)
                if on_released is not None and not queue:
                    results = HandAhead.results(running, outcomes)
                    if results is not None:
                        self._hand(on_released(results), holding, running, results)
                        on_released = None
                if on_poll is not None:
                    ahead = [item for item in running if not self._took(item)]
                    on_poll(
                        [item.task for item in running if item not in ahead],
                        [*(item.task for item in ahead), *(task for _, task in queue)],
                    )
                if running:
                    time.sleep(self.poll_s)
        except BaseException:
            self.backend.stop([item.proc for item in [*running, *self.hand_ahead.running()]])
            self.hand_ahead.clear()
            raise
        return [outcomes[i] for i in range(len(tasks))]

    def handed_ahead(self) -> set[str]:
        """The ids of the next call's tasks started ahead (see :meth:`run`'s ``on_released``)."""
        return self.hand_ahead.handed()

    @property
    def kept_ahead(self) -> list[str]:
        """The tasks of the last :meth:`run` that the one before had started (``on_released``)."""
        return self.hand_ahead.kept

    def _hand(
        self,
        tasks: list[TaskSpec],
        holding: list[list[Running]],
        running: list[Running],
        results: dict[str, ResultMessage],
    ) -> None:
        """Start the next call's ``tasks`` ahead on idle slots (:meth:`HandAhead.hand`)."""

        def start(task: TaskSpec, slot: int) -> Running | None:
            if not self._queues(slot, task):
                return None
            before = [h for h in self.hand_ahead.running() if h.slot == slot]
            before = before or [r for r in running if r.slot == slot]
            item = self._start(-1, task, slot, {r.port for r in running})
            item.behind = before[-1] if before else None
            return item

        idle = [slot for slot, held in enumerate(holding) if not held]
        self.hand_ahead.hand(tasks, idle, running, results, start, self.takes_together)
        if self.hand_ahead.handed():
            crash_point("ahead")

    def _discard(self, item: Running) -> None:
        """End a task handed ahead that is not to run."""
        self.backend.stop([item.proc])

    ahead = 0
    """Tasks a slot may be handed beyond the one it runs: a long-lived worker takes its next
    task the moment it releases the current one, without waiting for this controller."""
    takes_together = 1
    """Tasks a slot's worker runs at once (a long-lived worker's ``launch.members_per_batch``):
    as many of the next call's tasks are handed ahead to each idle slot."""

    def _next_slot(self, holding: list[list[Running]], task: TaskSpec) -> int | None:
        """The slot that takes ``task`` now: the lowest idle one, else (with :attr:`ahead`)
        the one holding the fewest tasks whose worker can queue it (the lowest of equals), so
        that workers taking several tasks at once get even shares; None: it waits."""
        for slot, held in enumerate(holding):
            if not held:
                return slot
        open_ = [
            slot
            for slot, held in enumerate(holding)
            if len(held) <= self.ahead and self._queues(slot, task)
        ]
        return min(open_, key=lambda slot: len(holding[slot]), default=None)

    def _queues(self, slot: int, task: TaskSpec) -> bool:
        """Whether ``slot``'s worker can take ``task`` after the one it runs."""
        return False

    def _took(self, item: Running) -> bool:
        """Whether ``item`` has started: always, unless it was handed ahead and its worker
        has not taken it yet."""
        if item.behind is not None and not item.taken:
            item.taken = (Path(item.task.task_dir) / "heartbeat").exists()
        return item.behind is None or item.taken

    def _lost(self, item: Running) -> bool:
        """Whether ``item``, handed ahead, can no longer start: its worker ended before
        taking it (it goes back to the queue; it was no attempt)."""
        return not self._took(item) and item.proc.poll() is not None

    def close(self) -> None:
        """Nothing outlives :meth:`run` here; a long-lived launcher stops its workers."""

    def _released(self, item: Running) -> bool:
        """Whether ``item``'s slot may take another task before ``item`` ends."""
        return False

    def _check_tasks(self, tasks: list[TaskSpec]) -> None:
        dirs = [Path(t.task_dir).resolve() for t in tasks]
        if len(set(dirs)) != len(dirs):
            raise ValueError("tasks share a task_dir; give each task its own directory")
        for task in tasks:
            if not (Path(task.task_dir) / "task.json").is_file():
                raise PbtError(
                    f"task {task.task_id}: {task.task_dir}/task.json does not exist; write it before run()"
                )
            if task.nproc < 1:
                raise ValueError(f"task {task.task_id}: nproc ({task.nproc}) must be >= 1")

    def _start(self, index: int, task: TaskSpec, slot: int, taken_ports: set[int]) -> Running:
        """Start the task's attempt (its previous attempt's files cleared), or watch the group
        a previous controller started for it (:attr:`TaskSpec.adopt`)."""
        if task.adopt is not None:
            group = self.backend.adopt(task.adopt, Path(task.task_dir))
            return Running(index, task, slot, 0, group, time.monotonic(), time.time())
        for stale in STALE_FILES:
            (Path(task.task_dir) / stale).unlink(missing_ok=True)
        return self._launch(index, task, slot, taken_ports)

    def _launch(self, index: int, task: TaskSpec, slot: int, taken_ports: set[int]) -> Running:
        """Start a process group for the task."""
        task_dir = Path(task.task_dir)
        port = self._pick_port(slot, taken_ports)
        proc = self._popen(slot, task.nproc, port, [str(task_dir / "task.json")], task.log_path)
        self.backend.record(proc, task_dir)
        return Running(index, task, slot, port, proc, time.monotonic(), time.time())

    def take_over(self, task_dir: Path) -> str | None:
        """What a crashed controller left running for ``task_dir``: the id of a job to adopt,
        or None once nothing of it runs any more (:meth:`ProcessBackend.take_over
        <pbt.launch.backend.ProcessBackend.take_over>`: local process groups are ended, Slurm
        jobs adopted)."""
        return self.backend.take_over(task_dir)

    def _popen(
        self, slot: int, nproc: int, port: int, tail: list[str], log_path: Path
    ) -> ProcessGroup:
        """The command with ``tail`` appended, as a process group of its own on the slot's
        GPUs, writing to ``log_path``."""
        spec = GroupSpec(
            command=[*self.command, *tail],
            nproc=nproc,
            port=port,
            log_path=Path(log_path),
            gpus=self.slot_gpus[slot],
            gpus_per_member=self.gpus_per_member,
            env=self.env,
            campaign_dir=self.campaign_dir,
            memory_limit_bytes=self.memory_limit_bytes,
        )
        return self.backend.start(spec)

    def _pick_port(self, slot: int, taken: set[int]) -> int:
        """A port for a command that names ``{port}``, free when chosen (not held: the
        default command binds its own); 0 for a command that needs none."""
        if not any("{port}" in arg for arg in self.command):
            return 0
        first = self.base_port + 10 * slot
        for port in range(first, min(first + 1000, 65536)):
            if port not in taken and port_is_free(port):
                return port
        raise PbtError(
            f"no free port in {first}..{first + 999} on 127.0.0.1; set another base_port"
        )

    def _check(self, item: Running) -> Outcome | None:
        """The task's outcome if it has ended (or was killed just now), else None."""
        returncode = item.proc.poll()
        if returncode is not None:
            self.backend.stop([item.proc])  # stragglers the leader left behind
            status, result, detail = _classify_exit(item.task.task_dir, returncode)
            if status == "failed":
                status, detail = classify_fault(item.task, detail, Path(item.task.log_path))
            outcome = self._outcome(item, returncode, status, result, detail)
            return self.backend.explain(item.proc, outcome)
        overdue = self._overdue(item)
        if overdue is None:
            return None
        status, reason = overdue
        (returncode,) = self.backend.stop([item.proc])
        return self._outcome(
            item, returncode, status, None, f"{reason}; {describe_exit(returncode)}"
        )

    def _overdue(self, item: Running) -> tuple[OutcomeStatus, str] | None:
        """Why a still-running task must be killed now, or None."""
        if self._waiting(item):  # queued by a scheduler: its clocks start when it runs
            item.started, item.started_wall = time.monotonic(), time.time()
            return None
        elapsed = time.monotonic() - item.started
        if self.task_timeout_s is not None and elapsed > self.task_timeout_s:
            return "timeout", f"ran {elapsed:.1f} s > task_timeout_s {self.task_timeout_s:g}"
        silent = time.time() - _last_beat(Path(item.task.task_dir) / "heartbeat", item.started_wall)
        if silent > self.heartbeat_timeout_s:
            limit = self.heartbeat_timeout_s
            return (
                "no_heartbeat",
                f"no heartbeat for {silent:.1f} s > heartbeat_timeout_s {limit:g}",
            )
        return None

    def _waiting(self, item: Running) -> bool:
        """Whether ``item`` waits for resources (a queued job) or, handed ahead, for the task
        before it on its worker to let go; its clocks start when it may run."""
        ahead = item.behind
        behind = not self._took(item) and not (ahead is None or ahead.released or ahead.ended)
        return behind or self.backend.waiting(item.proc)

    def _outcome(
        self,
        item: Running,
        returncode: int,
        status: OutcomeStatus,
        result: ResultMessage | None,
        detail: str,
    ) -> Outcome:
        tail = log_tail(Path(item.task.log_path)) if status != "ok" else ""
        if tail:
            detail = f"{detail}\n--- last lines of {item.task.log_path} ---\n{tail}"
        seconds = time.monotonic() - item.started
        return Outcome(item.task.task_id, status, returncode, result, detail, seconds)


def _classify_exit(
    task_dir: Path, returncode: int
) -> tuple[OutcomeStatus, ResultMessage | None, str]:
    """Status, result and detail of a task that exited by itself."""
    if returncode != 0:
        return "failed", None, describe_exit(returncode)
    path = Path(task_dir) / RESULT_FILE
    try:
        result = ResultMessage.read(path)
    except MessageError as err:
        return "bad_result", None, str(err)
    if result is None and path.exists():
        return "bad_result", None, "result.json is truncated or not a JSON object"
    if result is None:
        return "no_result", None, "exited 0 without writing result.json"
    return "ok", result, "exit code 0"


def classify_fault(task: TaskSpec, detail: str, log: Path) -> tuple[OutcomeStatus, str]:
    """The status and detail of a member that failed: the cause its worker reported and the
    worker's exit code first; ``out_of_memory``, ``disk_full``, ``diverged``,
    ``reward_error`` or ``config_error`` when the fault was of that kind (or the log ends in a MemoryError), else
    ``failed``."""
    tail = log_tail(Path(task.log_path)) or log_tail(log)
    cause = faults.read_cause(task.task_dir)
    fault = faults.read(task.task_dir, tail)
    status: OutcomeStatus = fault[0] if fault is not None else "failed"
    if cause is not None:
        code = "" if cause.exit_code is None else f"; worker {describe_exit(cause.exit_code)}"
        return status, f"{cause.message}{code}"
    worker = _AGENT_EXITCODE.search(tail)
    if worker is not None:
        detail = f"{detail} (worker {describe_exit(int(worker.group(1)))})"
    return status, detail if fault is None else f"{fault[1]}; {detail}"


def _last_beat(path: Path, started_wall: float) -> float:
    """Wall time of the last heartbeat; the start time while there has been none."""
    try:
        return max(path.stat().st_mtime, started_wall)
    except OSError:
        return started_wall
