"""Run member tasks of a campaign: the program the launcher starts under torchrun.

    torchrun --nproc_per_node=N -m pbt.worker <task_dir>/task.json     one task, then exit
    torchrun --nproc_per_node=N -m pbt.worker --serve <slot_folder>    a long-lived worker

The task (written by the controller) names the campaign's manifest, the member, its parent
checkpoint (or none: the base model), the hyperparameters, the steps to train and the seed. The
worker loads the parent checkpoint and only THEN applies the hyperparameters, so a mutated lr
lands in the optimizer's param groups with Adam's moments and the schedule's position kept. It
trains, evaluates, saves a gathered checkpoint and writes ``result.json`` (rank 0, atomically),
heartbeating all the while: the heartbeat carries its phase and, after each step, its step,
reward, tokens/s and ETA (:mod:`pbt.protocol.progress`). A member that collapses (no signal for
``algorithm.collapse_patience`` steps in a row) stops training early, is evaluated and saved all
the same, and its result says ``"fault": {"kind": "collapsed", ...}``
(:mod:`pbt.protocol.collapse`). It loads and saves checkpoints only inside the campaign's
``checkpoints`` folder. A task that fails says why in ``fault.json`` (:mod:`pbt.protocol.faults`):
its one-line cause, its kind (out of memory, disk full, diverged, configuration error) and the
exit code, before the worker exits: 2 for those and for any user error, 1 for a bug (whose
traceback follows in the log). A worker started by a campaign's controller ends (exit 3) once
that controller has died (:mod:`pbt.protocol.controller`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pbt.config import LaunchConfig, Manifest
from pbt.config.canonical import manifest_from_canonical
from pbt.config.errors import PbtError
from pbt.protocol import faults
from pbt.protocol.collapse import COLLAPSED, signal_summary
from pbt.protocol.controller import watch_controller
from pbt.protocol.files import RELEASED, Heartbeat, read_json, write_json_atomic
from pbt.protocol.paths import inside
from pbt.protocol.progress import ProgressReport
from pbt.protocol.records import member_seed


def run_task(
    task: dict[str, Any], host=None, heartbeat: Heartbeat | None = None
) -> tuple[dict[str, Any], Any]:
    """Train the member described by ``task`` and save its checkpoint; return its result and
    the host it trained on (every rank calls this; rank 0 passes its ``heartbeat``, which
    carries the task's progress).

    ``host`` is a model loaded by an earlier task of a long-lived worker: it is reused, its
    adapter reset, when the task's manifest is the one it was built for, so switching members
    costs an adapter, optimizer and RNG load, not a model load. A member gives the same
    checkpoint and fitness either way.
    """
    from pbt.distributed import barrier

    result, host, write = start_task(task, host, heartbeat)
    result = finish_task(result, write)
    barrier()  # every rank ends with the checkpoint on disk
    return result, host


def finish_task(result: dict[str, Any], write: Callable[[], str] | None) -> dict[str, Any]:
    """Write the checkpoint that :func:`start_task` snapshotted (rank 0); the result, complete."""
    if write is None:
        return result
    started = time.perf_counter()
    digest = write()
    seconds = time.perf_counter() - started
    return {**result, "digest": digest, "seconds": result["seconds"] + seconds, "write_s": seconds}


def start_task(
    task: dict[str, Any],
    host=None,
    heartbeat: Heartbeat | None = None,
    ahead: ParentAhead | None = None,
    loaded: Callable[[], object] | None = None,
    writing: Any = None,
) -> tuple[dict[str, Any], Any, Any]:
    """Train and evaluate the member described by ``task`` and snapshot its state to host
    memory (every rank calls this; rank 0 reports its progress to ``heartbeat``). Returns the
    result without its checkpoint's digest, the host, and on rank 0 the call that writes the
    checkpoint (:func:`finish_task`), which needs neither the device nor the other ranks; None
    on the others. A long-lived worker passes its ``ahead``: the parent it prefetched for this
    task, if any, and where to prefetch the next task's parent while this one trains,
    ``loaded``, called once the member is set up and its parent loaded, and ``writing``: the
    snapshot of its previous task, whose write may still be in flight. A task handed while its
    parent was being written (``parent_digest`` null) loads that snapshot's state."""
    import torch

    from pbt.algorithms.runtime.member import Host, Member, seed_everything
    from pbt.distributed import pick_device, world_info

    marks = [("start", time.perf_counter())]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    progress = ProgressReport(heartbeat, task["steps"])
    campaign = Path(task["campaign_dir"])
    checkpoint = inside(campaign, task["checkpoint"], "checkpoints", "the task's checkpoint")
    parent = task["parent_checkpoint"]
    if parent:
        parent = inside(campaign, parent, "checkpoints", "the task's parent checkpoint")
    manifest = _manifest(task)
    STATES.max_bytes = int(manifest.launch.state_cache_gib * 2**30)
    STATES.max_device_bytes = int(manifest.launch.device_state_cache_gib * 2**30)
    world = world_info()
    device = pick_device(manifest.training.device, world.local_rank)
    if host is not None and host.serves(manifest):
        host.reset_adapter()
    else:
        host = Host(manifest, device)
    member = Member(manifest, device, task["member_id"], host=host)
    marks.append(("setup", time.perf_counter()))
    held, prefetched, in_flight = None, False, False
    if parent and world.world_size == 1:
        key = (task["parent_checkpoint"], task.get("parent_digest"))
        in_flight = key[1] is None and getattr(writing, "cache_as", None) == key[0]
        if in_flight:
            held = writing.state()  # the parent's write is this worker's, maybe in flight
        else:
            held = ahead.take(*key) if ahead is not None else None
            prefetched = held is not None
            held = held if prefetched else STATES.get(*key)
    marks.append(("parent", time.perf_counter()))  # found in memory, or a prefetch waited for
    if parent:
        member.load(parent, held, owned=prefetched)
    member.learner.apply_hyperparameters(task["hyperparameters"])
    seed = member_seed(manifest.training.seed, task["member_id"])
    seed_everything(seed + world.rank)
    member.learner.generator.manual_seed(seed)
    if not parent:  # a child reads on from its parent's data position
        member.learner.data.restart(seed)
    member.lineage = {
        "member": task["member_id"],
        "parent": task["parent_id"],
        "generation": task["generation"],
        "mutation": task["mutation"],
    }
    started = time.perf_counter()
    marks.append(("load", started))
    if loaded is not None:
        loaded()
    history = _train(member, task["steps"], progress, ahead)
    marks.append(("train", time.perf_counter()))
    progress.phase("evaluating")
    fitness = member.learner.evaluate(
        member.task.eval, member.task.reward, manifest.training.eval_temperature
    )
    member.fitness.append(fitness)
    marks.append(("evaluate", time.perf_counter()))
    progress.phase("saving")  # till the result is written, by finish_task
    write = member.snapshot(checkpoint)
    marks.append(("save", time.perf_counter()))  # the snapshot; finish_task times the write
    if host.engine is not None:
        host.engine.forget(member.member_id)
    fault = {"kind": COLLAPSED, "detail": member.collapse_detail()} if member.collapsed else None
    timings = {name: end - begin for (_, begin), (name, end) in itertools.pairwise(marks)}
    result = {
        "status": "ok",
        "member_id": task["member_id"],
        "fitness": fitness,
        "metrics": (history[-1] if history else {}) | signal_summary(history),
        "history": history,
        "fault": fault,
        "steps": member.learner.step,
        "checkpoint": task["checkpoint"],
        "digest": None,
        "seconds": time.perf_counter() - started,
        "productive_seconds": timings["train"] + timings["evaluate"],
        "timings": timings,
        "world_size": world.world_size,
        "device": str(torch.device(member.device)),
        "parent_from": None if not parent else "memory" if held is not None else "disk",
        "parent_prefetched": prefetched,
        "parent_in_flight": in_flight,
        "parent_on_device": held is not None
        and (ahead.held_on_device if prefetched else _on_a_device(held)),
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated() / 2**30
            if torch.device(member.device).type == "cuda"
            else None
        ),
    }
    if write is not None and world.world_size == 1:
        write.cache_as = task["checkpoint"]  # kept once written: a child here needs no disk read
        write.keep_on_device = STATES.max_device_bytes > 0
    return result, host, write


class StateCache:
    """Members' states this worker snapshotted, in host memory by checkpoint path and digest,
    the oldest dropped past ``max_bytes``: a child of a member trained here loads its parent
    from memory, not from disk (whose copy is still written, for resume and other workers).

    On a GPU the most recent states are also kept on the device, up to ``max_device_bytes``
    (the packed buffers their host copies came from; older ones lose their device copy first):
    such a parent comes to a child in one device copy a buffer, not a copy from the host."""

    def __init__(self, max_bytes: int, max_device_bytes: int = 0) -> None:
        self.max_bytes, self.max_device_bytes = max_bytes, max_device_bytes
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(
        self,
        path: str,
        digest: str,
        attributes: dict[str, Any],
        nbytes: int,
        on_device: dict[str, Any] | None = None,
    ) -> None:
        from pbt.distributed.state import device_nbytes

        device_bytes = device_nbytes(on_device) if on_device is not None else 0
        if on_device is None or device_bytes > self.max_device_bytes:
            on_device, device_bytes = None, 0
        with self._lock:
            self._held.pop(path, None)
            if nbytes > self.max_bytes:
                return
            self._held[path] = _Held(
                digest,
                {**attributes, "digest": digest},
                nbytes,
                None if on_device is None else {**on_device, "digest": digest},
                device_bytes,
            )
            while sum(h.nbytes for h in self._held.values()) > self.max_bytes:
                self._held.popitem(last=False)
            over = sum(h.device_bytes for h in self._held.values()) - self.max_device_bytes
            for held in self._held.values():  # the least recently used first
                if over <= 0:
                    break
                if held.on_device is not None:
                    over -= held.device_bytes
                    held.on_device, held.device_bytes = None, 0

    def get(self, path: str, digest: str | None) -> dict[str, Any] | None:
        """The attributes of checkpoint ``path`` when held with exactly ``digest``: the copy
        on the device when there is one."""
        with self._lock:
            found = self._held.get(path)
            if digest is None or found is None or found.digest != digest:
                return None
            self._held.move_to_end(path)
            return found.attributes if found.on_device is None else found.on_device


@dataclasses.dataclass
class _Held:
    digest: str
    attributes: dict[str, Any]
    nbytes: int
    on_device: dict[str, Any] | None
    device_bytes: int


STATES = StateCache(int(LaunchConfig().state_cache_gib * 2**30))
"""The long-lived worker's cache, within the limits of the manifest of the task it serves
(``launch.state_cache_gib`` of host memory; of that, ``launch.device_state_cache_gib`` also
on the GPU), set as each task starts; the defaults' before the first."""


class ParentAhead:
    """A long-lived worker's prefetch: while it trains one task, the parent state of the task
    handed ahead to it (inbox entry :attr:`number`), when this worker holds that state in
    memory (:data:`STATES`), is copied to the device in the background
    (:class:`~pbt.distributed.state.DeviceCopies`; a state held on the device as well, in a
    device copy a buffer), so that the next task loads its parent without a copy. Looked for
    after each training step until found (the entry may be handed over, or the parent's write
    finish, while the task trains)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.number = 0
        self._key: tuple[str, str | None] | None = None
        self._copies = None
        self._looked: int | None = None  # the entry found to have no parent held here
        self.held_on_device = False

    def look(self, device) -> None:
        if self._copies is not None or self._looked == self.number:
            return
        entry = read_json(self.folder / "inbox" / f"{self.number:06d}.json")
        task = read_json(Path(entry["task"])) if entry is not None else None
        if task is None:
            return
        if not task.get("parent_checkpoint"):
            self._looked = self.number
            return
        key = (task["parent_checkpoint"], task.get("parent_digest"))
        held = STATES.get(*key)
        if held is None:  # not held here, or its write is still in flight
            return
        from pbt.distributed.state import DeviceCopies

        self._key, self._copies = key, DeviceCopies(held, device)

    def take(self, path: str, digest: str | None) -> dict[str, Any] | None:
        """The prefetched state of checkpoint ``path`` with ``digest``, or None
        (:attr:`held_on_device` says whether it was copied from a state held on the device)."""
        copies, key = self._copies, self._key
        self._copies = self._key = None
        self.held_on_device = False
        if copies is None or key != (path, digest):
            return None
        tree = copies.wait()
        self.held_on_device = copies.held_on_device
        return tree


def _on_a_device(tree: Any) -> bool:
    from pbt.distributed.state import device_nbytes

    return device_nbytes(tree) > 0


def _train(
    member, steps: int, progress: ProgressReport, ahead: ParentAhead | None = None
) -> list[dict[str, float]]:
    """Train ``steps`` steps, a line per step in the member's log and in its progress; every
    step's metrics, with the lineage's step count."""

    def say(line: str) -> None:
        print(f"{member.member_id} {line}", flush=True)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        say(f"step {step} {member.learner.describe(metrics)}")
        progress.stepped(metrics)
        if ahead is not None:
            ahead.look(member.device)

    progress.phase("training")
    return member.train(steps, on_step, say)


def _manifest(task: dict[str, Any]) -> Manifest:
    """The task's manifest, parsed once per worker process for each distinct manifest: every
    task of a campaign carries the same one, in canonical form, which the controller translated
    and validated already (read back here with the same rules, translating nothing)."""
    text = json.dumps(task["manifest"], sort_keys=True)
    return _parsed_manifest(text, str(task["manifest_base_dir"]))


@functools.lru_cache(maxsize=4)
def _parsed_manifest(text: str, base_dir: str) -> Manifest:
    return manifest_from_canonical(json.loads(text), base_dir=base_dir)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m pbt.worker TASK_JSON`` (one task), or ``python -m pbt.worker
    --serve FOLDER [--idle-timeout S]`` (a long-lived worker; see
    :class:`pbt.launch.local.PersistentLauncher`)."""
    argv = sys.argv[1:] if argv is None else argv
    faults.keep_reserve()  # freed before a fault report, which may come at the memory limit
    watch_controller(_controller_gone)
    if argv[:1] == ["--serve"] and len(argv) in (2, 4):
        idle = float(argv[3]) if len(argv) == 4 and argv[2] == "--idle-timeout" else 900.0
        return serve(Path(argv[1]), idle)
    if len(argv) != 1:
        print(
            "usage: python -m pbt.worker TASK_JSON | --serve FOLDER [--idle-timeout S]",
            file=sys.stderr,
        )
        return 2
    task_path = Path(argv[0])
    task = read_json(task_path)
    if task is None:
        print(f"error: {task_path} is missing or not valid JSON", file=sys.stderr)
        return 2
    from pbt.distributed import shutdown

    rank = int(os.environ.get("RANK", 0))
    beat = Heartbeat(task_path.parent / "heartbeat") if rank == 0 else contextlib.nullcontext()
    with beat as heartbeat:
        try:
            result, _ = run_task(task, heartbeat=heartbeat)
        except BaseException as err:
            if not _failed(task_path.parent, err):
                raise
            return 2
        finally:
            shutdown()
        if rank == 0:
            write_json_atomic(task_path.parent / "result.json", result)
    return 0


def serve(folder: Path, idle_timeout_s: float = 900.0, poll_s: float = 0.005) -> int:
    """Run the tasks handed to ``folder/inbox`` in order, on one model loaded once.

    Every rank reads the same inbox, so the group agrees on each task without a collective
    while it waits. Once a task's state is snapshotted to host memory, rank 0 marks the task
    ``released`` (the launcher may hand over the next one) and writes the checkpoint, then
    ``result.json``, from a background thread while the next task trains; the task heartbeats
    until its result is written. At most one write is in flight. When the next task is already
    handed over, the write starts once that task has loaded its member: the write's first
    steps (settling the copies, pickling) hold the interpreter, and would slow the switch of
    member, which nothing overlaps. Ends on a ``stop`` file, when
    the folder is gone, or after ``idle_timeout_s`` without a task, in each case after the
    write in flight. A task that fails ends the worker (exit 2), since its ranks may be out of
    step; so does a failed write (the task in training then fails with it, and is retried).
    Each rank also ends (exit 3, at once) within a second or two of its controller's death
    (:func:`pbt.protocol.controller.watch_controller`, started by :func:`main`).
    """
    from pbt.distributed import shutdown

    rank = int(os.environ.get("RANK", 0))
    host, taken, writing = None, 0, None
    ahead = ParentAhead(folder) if int(os.environ.get("WORLD_SIZE", 1)) == 1 else None
    try:
        while True:
            if writing is not None and not (folder / "inbox" / f"{taken:06d}.json").exists():
                writing.go()  # no task waits to load a member: nothing for the write to slow
            entry = _next_entry(folder, taken, idle_timeout_s, poll_s)
            if entry is None:
                return 0
            taken += 1
            task_path = Path(entry["task"])
            task = read_json(task_path)
            if task is None:
                print(f"error: {task_path} is missing or not valid JSON", file=sys.stderr)
                return 2
            beat = Heartbeat(task_path.parent / "heartbeat") if rank == 0 else None
            with contextlib.ExitStack() as stack:
                if beat is not None:
                    stack.enter_context(beat)
                with _output_to(entry["log"], rank == 0):
                    if ahead is not None:
                        ahead.number = taken  # the entry after this one
                    try:
                        go = writing.go if writing is not None else None
                        result, host, write = start_task(
                            task,
                            host,
                            beat,
                            ahead,
                            go,
                            writing=writing.write if writing is not None else None,
                        )
                    except BaseException as err:
                        if not _failed(task_path.parent, err):
                            raise
                        return 2
                if rank == 0:
                    if writing is not None:
                        writing.finish()
                    # the write owns the heartbeat from here on, till the result is written
                    writing = _Writer(
                        task_path.parent, entry["log"], result, write, stack.pop_all()
                    )
    finally:
        if writing is not None:
            writing.finish()
        shutdown()


class _Writer(threading.Thread):
    """Writes a served task's checkpoint, then its ``result.json``, in the background; on
    failure reports the fault (:mod:`pbt.protocol.faults`) and ends the worker with exit 2."""

    def __init__(
        self,
        task_dir: Path,
        log: str,
        result: dict[str, Any],
        write: Callable[[], str],
        heartbeat: contextlib.ExitStack,
    ) -> None:
        super().__init__(name="pbt-checkpoint-writer", daemon=True)
        self.task_dir, self.log, self.result = task_dir, log, result
        self.write, self.heartbeat = write, heartbeat
        # the result but the checkpoint's digest: the controller may choose the next generation
        # from it while the write runs (the task ends when result.json arrives)
        write_json_atomic(task_dir / RELEASED, result, durable=False)

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
                path = getattr(self.write, "cache_as", None)
                if path is not None and result.get("digest"):
                    STATES.put(
                        path,
                        result["digest"],
                        self.write.attributes,
                        self.write.nbytes(),
                        on_device=getattr(self.write, "on_device", None),
                    )
                if self.write is not None:
                    self.write.on_device = None  # kept by the cache alone, if at all
                write_json_atomic(self.task_dir / "result.json", result)
        except BaseException as err:
            kind = faults.report(self.task_dir, err, exit_code=2)
            with contextlib.suppress(OSError), open(self.log, "a") as f:
                traceback.print_exc(file=f)
                what = kind.replace("_", " ") if kind else "writing the checkpoint failed"
                print(f"error: {what}: {err}", file=f)
            os._exit(2)


def _failed(task_dir: Path, err: BaseException) -> bool:
    """Say why the task failed, and whether that was expected: a user's error (its message
    only) or a fault of a known kind (with its traceback); either exits 2. Other errors are
    bugs, left to propagate (exit 1). Each is reported in ``fault.json`` with its exit code."""
    try:
        kind = faults.classify(err)
    except MemoryError:  # at the limit, with nothing left to judge the error with
        kind = "out_of_memory"
    expected = kind is not None or isinstance(err, PbtError)
    if isinstance(err, Exception):  # not an interrupt
        faults.report(task_dir, err, exit_code=2 if expected else 1)
    if isinstance(err, PbtError):
        print(f"error: {err}", file=sys.stderr)
    elif kind is not None:
        traceback.print_exc()
        print(f"error: {kind.replace('_', ' ')}: {err}", file=sys.stderr)
    return expected


CONTROLLER_GONE_EXIT = 3
"""The exit code of a worker whose controller died: no one is left to read its results."""


def _controller_gone(pid: int) -> None:
    """End this process at once: its controller (``pid``) has died, and a resumed one runs its
    task again; a checkpoint write cut off here leaves only a temporary folder behind."""
    print(f"error: the controller (pid {pid}) has ended; this worker stops", file=sys.__stderr__)
    os._exit(CONTROLLER_GONE_EXIT)


def _next_entry(
    folder: Path, number: int, idle_timeout_s: float, poll_s: float
) -> dict[str, Any] | None:
    """Wait for inbox entry ``number``; None when the worker should stop."""
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
def _output_to(log: str, enabled: bool):
    """This rank's prints go to the task's log while the task runs."""
    if not enabled:
        yield
        return
    with (
        open(log, "a", buffering=1) as f,
        contextlib.redirect_stdout(f),
        contextlib.redirect_stderr(f),
    ):
        yield


if __name__ == "__main__":
    sys.exit(main())
