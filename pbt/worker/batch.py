"""Several member tasks of one generation run as one population batch on a long-lived worker
(``launch.members_per_batch``).

The worker takes up to ``members_per_batch`` tasks that are in its inbox together (the launcher
hands a slot that many, and more behind them) when they share a manifest and a step count, and
hosts their members on its one base model
(:class:`~pbt.algorithms.runtime.shared_base.SharedBase`): each member set up as its task alone
would set it up (its parent loaded, THEN its hyperparameters applied; seeded), the members
trained in lock step with their rollouts in one batch
(:func:`~pbt.algorithms.runtime.population_train.train_together`), then each evaluated and
snapshotted (their greedy evaluations sampled together too). Each task ends as it would alone: its own result, checkpoint, heartbeat
and log, so selection, the store, resume, the hand-ahead and the state caches see separate
tasks. A member whose training fails (it diverged) fails its own task; the others of the batch
finish and are written, and the worker then ends (exit 2), as it does after any failed task.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pbt.protocol.files import Heartbeat, read_json
from pbt.protocol.messages import ResultMessage, TaskMessage
from pbt.protocol.paths import inside
from pbt.protocol.progress import ProgressReport
from pbt.protocol.records import member_seed
from pbt.worker import cache
from pbt.worker.task import _find_parent, _manifest, _prepare, _result

GATHER_S = 0.5
"""How long a worker that took a task waits for the rest of its batch to be handed: the
launcher writes a batch's entries one after another, milliseconds apart."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ran:
    """One task of a batch: its result and snapshot (rank 0's), or the error that failed it."""

    task: TaskMessage
    result: ResultMessage | None = None
    write: Any = None
    error: BaseException | None = None


def batch_size(task: TaskMessage, world_size: int) -> int:
    """How many tasks a worker runs together with ``task``: its manifest's
    :attr:`~pbt.config.Manifest.worker_batch` on one rank; else 1."""
    return _manifest(task).worker_batch if world_size == 1 else 1


def gather(folder: Path, number: int, first: TaskMessage, size: int) -> list[dict[str, Any]]:
    """The inbox entries from ``number`` on that join ``first``'s batch: handed within
    :data:`GATHER_S`, with the same manifest and steps, at most ``size - 1`` of them."""
    entries: list[dict[str, Any]] = []
    deadline = time.monotonic() + GATHER_S
    while len(entries) < size - 1 and time.monotonic() < deadline:
        entry = read_json(folder / "inbox" / f"{number + len(entries):06d}.json")
        if entry is None:
            time.sleep(0.005)
            continue
        task = TaskMessage.peek(Path(entry["task"]))
        if task is None:  # not readable yet, or not a task: left for the loop to judge
            break
        if task.manifest != first.manifest or task.steps != first.steps:
            break
        entries.append(entry)
    return entries


def start_batch(
    tasks: list[TaskMessage],
    host: Any,
    heartbeats: list[Heartbeat | None],
    writing: list[Any],
    loaded: Callable[[], object] | None = None,
) -> tuple[list[Ran], Any]:
    """Run ``tasks`` as one population batch (see the module); each task's outcome, in order,
    and the host. ``writing``: the snapshots of the worker's previous tasks whose writes may
    still run (a parent handed with a null digest is one of them); ``loaded`` is called once
    every member is set up."""
    import torch

    from pbt.algorithms.runtime.member import Host
    from pbt.algorithms.runtime.shared_base import SharedBase
    from pbt.distributed import pick_device, world_info

    marks = [("start", time.perf_counter())]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    world = world_info()
    manifest = _manifest(tasks[0])
    cache.apply_sizes(manifest.launch)
    device = pick_device(manifest.training.device, world.local_rank)
    if host is None or not host.serves(manifest):
        host = Host(manifest, device)
    shared = SharedBase(manifest, device, host=host)
    progress = {
        t.member_id: ProgressReport(b, t.steps) for t, b in zip(tasks, heartbeats, strict=True)
    }
    parents = {}
    for task in tasks:
        member = shared.add(task.member_id, member_seed(manifest.training.seed, task.member_id))
        shared.activate(task.member_id)
        in_flight = next(
            (w for w in writing if w is not None and w.cache_as == task.parent_checkpoint), None
        )
        parents[task.member_id] = _find_parent(task, world.world_size, None, in_flight)
        _prepare(member, task, parents[task.member_id], world.rank)
    marks.append(("load", time.perf_counter()))
    started = marks[-1][1]
    if loaded is not None:
        loaded()
    trained = _train(shared, tasks, progress)
    marks.append(("train", time.perf_counter()))
    fitness, seconds = _evaluate_all(
        shared, [t.member_id for t in tasks if trained[t.member_id].error is None], progress
    )
    out = []
    for task in tasks:
        got = trained[task.member_id]
        if got.error is not None:
            out.append(Ran(task, error=got.error))
            continue
        evaluated = (fitness[task.member_id], seconds)
        out.append(
            _finish(shared, task, got.history, parents[task.member_id], evaluated, marks, started)
        )
    return out, host


def _train(shared, tasks: list[TaskMessage], progress: dict[str, ProgressReport]):
    from pbt.algorithms.runtime.population_train import train_together

    def say(member_id: str) -> Callable[[str], None]:
        return lambda line: print(f"{member_id} {line}", flush=True)

    def on_step(member_id: str):
        member = shared.member(member_id)

        def call(step: int, metrics: dict[str, float]) -> None:
            say(member_id)(f"step {step} {member.learner.describe(metrics)}")
            progress[member_id].stepped(metrics)

        return call

    for report in progress.values():
        report.phase("training")
    return train_together(shared, [t.member_id for t in tasks], tasks[0].steps, on_step, say)


def _evaluate_all(shared, ids: list[str], progress: dict[str, ProgressReport]):
    """The trained members' fitness, their evaluations sampled together
    (:func:`~pbt.algorithms.runtime.population_train.evaluate_together`), each appended to its
    member's history; and the seconds it took (the batch's, in each member's timings)."""
    from pbt.algorithms.runtime.population_train import evaluate_together

    begin = time.perf_counter()
    for member_id in ids:
        progress[member_id].phase("evaluating")
    temperature = shared.manifest.training.eval_temperature
    fitness = evaluate_together(shared, ids, temperature) if ids else {}
    for member_id in ids:
        shared.member(member_id).fitness.append(fitness[member_id])
        progress[member_id].phase("saving")
    return fitness, time.perf_counter() - begin


def _finish(shared, task, history, parent, evaluated, marks, started) -> Ran:
    """Snapshot one trained and evaluated member of the batch (``evaluated``: its fitness and
    the batch's evaluation seconds); its result without a digest."""
    from pbt.distributed import world_info

    world = world_info()
    member = shared.activate(task.member_id)
    fitness, evaluate_s = evaluated
    begin = time.perf_counter()
    checkpoint = inside(
        Path(task.campaign_dir), task.checkpoint, "checkpoints", "the task's checkpoint"
    )
    write = member.snapshot(checkpoint)
    timings = {name: end - start for (_, start), (name, end) in itertools.pairwise(marks)}
    timings |= {"evaluate": evaluate_s, "save": time.perf_counter() - begin}
    result = _result(task, member, fitness, history, parent, timings, world.world_size)
    if write is not None and world.world_size == 1:
        write.cache_as = task.checkpoint
        write.keep_on_device = cache.STATES.max_device_bytes > 0
    seconds = time.perf_counter() - started
    return Ran(task, dataclasses.replace(result, seconds=seconds), write)
