"""One member task of a campaign: resolve the parent, train, evaluate, snapshot, result.

    torchrun --nproc_per_node=N -m pbt.worker <task_dir>/task.json     one task, then exit
    torchrun --nproc_per_node=N -m pbt.worker --serve <slot_folder>    a long-lived worker

(the entry point is :mod:`pbt.worker.main`; the long-lived worker :mod:`pbt.worker.serve`, its
state caches :mod:`pbt.worker.cache`). The task (a :class:`~pbt.protocol.messages.TaskMessage`,
written by the controller) names the campaign's manifest, the member, its parent
checkpoint (or none: the base model), the hyperparameters, the steps to train and the seed. The
worker loads the parent checkpoint and only THEN applies the hyperparameters, so a mutated lr
lands in the optimizer's param groups with Adam's moments and the schedule's position kept. It
trains, evaluates, saves a gathered checkpoint and writes ``result.json`` (a
:class:`~pbt.protocol.messages.ResultMessage`; rank 0, atomically),
heartbeating all the while: the heartbeat carries its phase and, after each step, its step,
reward, tokens/s and ETA (:mod:`pbt.protocol.progress`). A member that collapses (no signal for
``algorithm.collapse_patience`` steps in a row) stops training early, is evaluated and saved all
the same, and its result's ``fault`` says ``collapsed``
(:mod:`pbt.protocol.collapse`). It loads and saves checkpoints only inside the campaign's
``checkpoints`` folder. A task that fails says why in ``fault.json`` (:mod:`pbt.protocol.faults`):
its one-line cause, its kind (out of memory, disk full, diverged, configuration error) and the
exit code, before the worker exits: 2 for those and for any user error, 1 for a bug (whose
traceback follows in the log). A worker started by a campaign's controller ends (exit 3) once
that controller has died (:mod:`pbt.protocol.controller`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pbt.config import Manifest
from pbt.config.errors import PbtError
from pbt.config.read.canonical import manifest_from_canonical
from pbt.protocol import faults
from pbt.protocol.collapse import COLLAPSED, signal_summary
from pbt.protocol.files import Heartbeat
from pbt.protocol.messages import Fault, MessageError, ResultMessage, TaskMessage
from pbt.protocol.paths import inside, plain_name
from pbt.protocol.progress import ProgressReport
from pbt.protocol.records import member_seed
from pbt.worker import cache


def read_task(task_path: Path) -> TaskMessage | None:
    """The task at ``task_path``, or None after one line on stderr saying why it cannot be
    read (the worker then exits 2)."""
    try:
        task = TaskMessage.read(task_path)
    except MessageError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    if task is None:
        print(f"error: {task_path} is missing or not valid JSON", file=sys.stderr)
    return task


def run_task(
    task: TaskMessage, host: Any = None, heartbeat: Heartbeat | None = None
) -> tuple[ResultMessage, Any]:
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


def finish_task(result: ResultMessage, write: Any) -> ResultMessage:
    """Write the checkpoint that :func:`start_task` snapshotted (rank 0, ``write`` a
    :class:`~pbt.algorithms.runtime.member.Snapshot`); the result, complete."""
    if write is None:
        return result
    started = time.perf_counter()
    digest = write()
    seconds = time.perf_counter() - started
    return dataclasses.replace(
        result, digest=digest, seconds=(result.seconds or 0.0) + seconds, write_s=seconds
    )


@dataclasses.dataclass(slots=True)
class _Parent:
    """Where a task's parent state comes from: its checkpoint on disk (``path``; None: the
    base model) and, when this worker holds it in memory, that state (``held``)."""

    path: Path | None
    held: dict[str, Any] | None = None
    prefetched: bool = False
    """``held`` was copied to the device while the task before trained (:class:`ParentAhead`)."""
    in_flight: bool = False
    """``held`` is the snapshot of this worker's previous task, whose write may still run."""
    on_device: bool = False

    @property
    def source(self) -> str | None:
        if self.path is None:
            return None
        return "memory" if self.held is not None else "disk"


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """What a long-lived worker (:mod:`pbt.worker.serve`) gives a task besides the task."""

    ahead: cache.ParentAhead | None = None
    """The parent it prefetched for this task, if any, and where to prefetch the next task's
    parent while this one trains."""
    loaded: Callable[[], object] | None = None
    """Called once the member is set up and its parent loaded (the previous write may start)."""
    writing: Any = None
    """The :class:`~pbt.algorithms.runtime.member.Snapshot` of its previous task, whose write may still
    be in flight: a task handed while its parent was being written (``parent_digest`` null)
    loads that state."""


def start_task(
    task: TaskMessage,
    host: Any = None,
    heartbeat: Heartbeat | None = None,
    served: Served | None = None,
) -> tuple[ResultMessage, Any, Any]:
    """Train and evaluate the member described by ``task`` and snapshot its state to host
    memory (every rank calls this; rank 0 reports its progress to ``heartbeat``). Returns the
    result without its checkpoint's digest, the host, and on rank 0 the snapshot that writes
    the checkpoint (:func:`finish_task`), which needs neither the device nor the other ranks;
    None on the others. The steps: set up the member, find its parent, load it and apply the
    task, train, evaluate, snapshot."""
    import torch

    from pbt.distributed import world_info

    served = Served() if served is None else served
    ahead = served.ahead

    marks = [("start", time.perf_counter())]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    progress = ProgressReport(heartbeat, task.steps)
    campaign = Path(task.campaign_dir)
    checkpoint = inside(campaign, task.checkpoint, "checkpoints", "the task's checkpoint")
    world = world_info()
    member, host = _member(task, host, world)
    marks.append(("setup", time.perf_counter()))
    parent = _find_parent(task, world.world_size, ahead, served.writing)
    marks.append(("parent", time.perf_counter()))  # found in memory, or a prefetch waited for
    _prepare(member, task, parent, world.rank)
    started = time.perf_counter()
    marks.append(("load", started))
    if served.loaded is not None:
        served.loaded()
    history = _train(member, task.steps, progress, ahead)
    marks.append(("train", time.perf_counter()))
    fitness = _evaluate(member, progress)
    marks.append(("evaluate", time.perf_counter()))
    write = member.snapshot(checkpoint)
    marks.append(("save", time.perf_counter()))  # the snapshot; finish_task times the write
    if host.engine is not None:
        host.engine.forget(member.member_id)
    timings = {name: end - begin for (_, begin), (name, end) in itertools.pairwise(marks)}
    result = _result(task, member, fitness, history, parent, timings, world.world_size)
    if write is not None and world.world_size == 1:
        write.cache_as = task.checkpoint  # kept once written: a child here needs no disk read
        write.keep_on_device = cache.STATES.max_device_bytes > 0
    return dataclasses.replace(result, seconds=time.perf_counter() - started), host, write


def _member(task: TaskMessage, host: Any, world: Any) -> tuple[Any, Any]:
    """The task's member on ``host`` when that serves its manifest (its adapter reset), else
    on a new host; and the host."""
    from pbt.algorithms.runtime.member import Host, Member
    from pbt.distributed import pick_device

    manifest = _manifest(task)
    cache.apply_sizes(manifest.launch)
    device = pick_device(manifest.training.device, world.local_rank)
    if host is not None and host.serves(manifest):
        host.reset_adapter()
    else:
        host = Host(manifest, device)
    member_dir = plain_name(task.member_id, "the task's member id")
    status_dir = Path(task.campaign_dir) / "tasks" / member_dir  # the task's own folder
    return Member(manifest, device, task.member_id, host=host, engine_status_dir=status_dir), host


def _find_parent(
    task: TaskMessage, world_size: int, ahead: cache.ParentAhead | None, writing: Any
) -> _Parent:
    """Where the parent state comes from: on one rank, this worker's snapshot still being
    written (a task handed with a null ``parent_digest``), a prefetch, or the state cache;
    else the disk."""
    if not task.parent_checkpoint:
        return _Parent(None)
    campaign = Path(task.campaign_dir)
    path = inside(campaign, task.parent_checkpoint, "checkpoints", "the task's parent checkpoint")
    parent = _Parent(path)
    if world_size != 1:
        return parent
    key = (task.parent_checkpoint, task.parent_digest)
    parent.in_flight = key[1] is None and writing is not None and writing.cache_as == key[0]
    if parent.in_flight:
        parent.held = writing.state()  # the parent's write is this worker's, maybe in flight
    elif ahead is not None and (held := ahead.take(*key)) is not None:
        parent.held, parent.prefetched = held, True
    else:
        parent.held = cache.STATES.get(*key)
    if parent.held is not None:
        parent.on_device = ahead.held_on_device if parent.prefetched else _on_a_device(parent.held)
    return parent


def _prepare(member: Any, task: TaskMessage, parent: _Parent, rank: int) -> None:
    """Load the parent, THEN apply the task's hyperparameters; seed; record the lineage."""
    from pbt.algorithms.runtime.member import seed_everything

    if parent.path is not None:
        member.load(parent.path, parent.held, owned=parent.prefetched)
    member.learner.apply_hyperparameters(task.hyperparameters)
    seed = member_seed(member.manifest.training.seed, task.member_id)
    seed_everything(seed + rank)
    member.learner.generator.manual_seed(seed)
    if parent.path is None:  # a child reads on from its parent's data position
        member.learner.data.restart(seed)
    member.lineage = {
        "member": task.member_id,
        "parent": task.parent_id,
        "generation": task.generation,
        "mutation": task.mutation,
    }


def _evaluate(member: Any, progress: ProgressReport) -> float:
    """The member's held-out fitness, appended to its history; the progress then says
    ``saving`` till the result is written (by :func:`finish_task`)."""
    progress.phase("evaluating")
    task, temperature = member.task, member.manifest.training.eval_temperature
    fitness = member.learner.evaluate(task.eval, task.reward, temperature)
    member.fitness.append(fitness)
    progress.phase("saving")
    return fitness


def _result(
    task: TaskMessage,
    member: Any,
    fitness: float,
    history: list[dict[str, float]],
    parent: _Parent,
    timings: dict[str, float],
    world_size: int,
) -> ResultMessage:
    """The task's result, before its checkpoint is written (no digest)."""
    import torch

    device = torch.device(member.device)
    fault = Fault(kind=COLLAPSED, detail=member.collapse_detail()) if member.collapsed else None
    return ResultMessage(
        status="ok",
        member_id=task.member_id,
        fitness=fitness,
        metrics=(history[-1] if history else {}) | signal_summary(history),
        history=history,
        fault=fault,
        steps=member.learner.step,
        checkpoint=task.checkpoint,
        digest=None,
        productive_seconds=timings["train"] + timings["evaluate"],
        timings=timings,
        world_size=world_size,
        device=str(device),
        parent_from=parent.source,  # type: ignore[arg-type]
        parent_prefetched=parent.prefetched,
        parent_in_flight=parent.in_flight,
        parent_on_device=parent.held is not None and parent.on_device,
        peak_memory_gib=(
            torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        ),
    )


def _on_a_device(tree: Any) -> bool:
    from pbt.distributed.state import device_nbytes

    return device_nbytes(tree) > 0


def _train(
    member: Any, steps: int, progress: ProgressReport, ahead: cache.ParentAhead | None = None
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


def _manifest(task: TaskMessage) -> Manifest:
    """The task's manifest, parsed once per worker process for each distinct manifest: every
    task of a campaign carries the same one, in canonical form, which the controller translated
    and validated already (read back here with the same rules, translating nothing)."""
    text = json.dumps(task.manifest, sort_keys=True)
    return _parsed_manifest(text, task.manifest_base_dir)


@functools.lru_cache(maxsize=4)
def _parsed_manifest(text: str, base_dir: str) -> Manifest:
    return manifest_from_canonical(json.loads(text), base_dir=base_dir)


def failed(task_dir: Path, err: BaseException) -> bool:
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
