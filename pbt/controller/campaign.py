"""A campaign: generations of members, each trained as its own torchrun group, then selected
and mutated, until the budget is spent. Resumable from its directory after any crash.

Directory layout::

    <campaign>/store.db           the campaign store (config, members, lineage, faults, RNG)
    <campaign>/controller.lock    held by the one controller running this campaign (see lock.py)
    <campaign>/tasks/<member>/    task.json, heartbeat, result.json
    <campaign>/logs/<member>.attempt<k>.log
    <campaign>/checkpoints/<member>/

Each generation boundary is one store transaction that also carries the controller's RNG state,
so a resumed campaign makes exactly the decisions an uninterrupted one would. The store keeps
the manifest's sections as the user wrote them (AgileRL's spellings included), from which
``resume`` rebuilds the same :class:`Manifest`; each task carries the manifest in its canonical
form (:mod:`pbt.config.read.canonical`), translated and validated once, here. This module imports no
torch: members are separate processes.

One generation (here g1 on two slots of long-lived workers; without them, nothing is handed
ahead and g2 starts after the commit)::

    slot 0 | g1-m0: load parent, train, eval |R| write g1-m0 |
    slot 1 | g1-m1: load parent, train, eval      |R| write g1-m1 ..........|
                                                   ^ every result known (R: "released")
           guess:  select and mutate g1 from those results, recording nothing (_guess_next)
           hand:   g2's first tasks to the idle slots' workers (pbt.launch.handahead); a
                   child whose parent is still being written only to the worker writing it
    slot 0                                          | g2-m0 (handed ahead) ..............
    slot 1                                          | g2-m1 (handed ahead; its parent
                                                    |  g1-m1 from this worker's memory) ..
                                                                             ^ last write
           commit: g1's results, selection run again from the store with the committed
                   RNG state, g2's members: one transaction; g2's task.json files written
           adopt:  each handed task whose task.json is unchanged (a null parent digest now
                   the written one's) runs on; any other is ended and started afresh, with
                   the tasks not handed

A guess that does not hold (a write that failed, a budget reached meanwhile) costs the work
started on it, never a decision: the commit decides, as it would without the guess.

The controller writes, loads and deletes only inside its directory: a member id, or a checkpoint
path from the store or from a member's result, that would lead elsewhere (``..``, an absolute
path, a symlink) is refused (:mod:`pbt.protocol.paths`). A member that cannot write its checkpoint
because the disk is full stops the campaign after its last attempt, rather than being replaced
by clones that would fail the same way: free space, then ``pbt resume``.
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pbt.config import Manifest
from pbt.config.errors import ConfigError, PbtError
from pbt.config.read.loader import manifest_from_dict, read_manifest_file
from pbt.config.read.overrides import with_environment
from pbt.controller.budget import (
    FLAGS,
    Spent,
    change_problems,
    exhausted,
    spent_by,
    spent_problems,
    with_budget,
)
from pbt.controller.campaign_log import CampaignLog
from pbt.controller.garbage import collect_garbage
from pbt.controller.lock import ControllerLock
from pbt.controller.outcomes import Outcomes, applied
from pbt.controller.progress import Plan, ProgressDisplay
from pbt.controller.store import STORE_FILENAME, CampaignStore
from pbt.controller.task_files import write_task
from pbt.evolution.breeding import (
    breed,
    build_mutations,
    build_pb2,
    build_selection,
    initial_records,
    selection_events,
)
from pbt.evolution.search import study_storage
from pbt.evolution.trials import Trials
from pbt.launch.attempt import Outcome, TaskSpec
from pbt.launch.build import build_launcher, member_env
from pbt.launch.handahead import HandAhead
from pbt.launch.local import LocalLauncher
from pbt.launch.mps import MpsDaemon
from pbt.launch.placement import Placement, placement_for
from pbt.launch.processes import end_campaign_processes
from pbt.protocol.crash import crash_point
from pbt.protocol.faults import NOT_RETRIED
from pbt.protocol.messages import ResultMessage
from pbt.protocol.paths import inside, plain_name
from pbt.protocol.records import MemberRecord, rng_from_json, rng_to_json


@dataclass(frozen=True, slots=True)
class Summary:
    """How a campaign ended."""

    generations: int
    best_member: str
    best_fitness: float
    best_checkpoint: str
    stop_reason: str


class Campaign:
    """One campaign directory, driven by one controller at a time.

    Use :meth:`start` for a new campaign and :meth:`resume` to continue one.
    """

    def __init__(
        self,
        directory: Path,
        raw: dict[str, Any],
        manifest: Manifest,
        member_command: list[str] | None = None,
    ) -> None:
        self.dir = directory
        self.raw = raw  # what the store keeps: the sections as written, and their folder
        self.manifest = manifest  # validated once by start or resume, the environment's
        # overrides applied (pbt.config.read.overrides); what members are handed
        self.say = _say
        self._lock = ControllerLock.acquire(directory, say=self.say)
        self.store = CampaignStore(directory / STORE_FILENAME)
        self.selection = build_selection(self.manifest)
        self.mutations = build_mutations(self.manifest)
        self.member_command = member_command
        self.log = CampaignLog(directory, self.manifest)
        self._workers: LocalLauncher | None = None
        self._mps: MpsDaemon | None = None
        self._placement: Placement | None = None
        self.hand_ahead = HandAhead()
        """The next generation's tasks handed ahead to long-lived workers (see :meth:`_guess_next`)."""
        self.outcomes = Outcomes(
            directory, self.manifest, self.store, self.log, lambda x: self.say(x)
        )

    # -- creation and resume ---------------------------------------------------------------

    @classmethod
    def start(
        cls,
        manifest_path: str | Path,
        directory: str | Path,
        member_command: list[str] | None = None,
        budget: dict[str, Any] | None = None,
    ) -> Campaign:
        """Create ``directory`` as a new campaign from a manifest file and build generation 0.

        The file is read and validated once, before anything is created; the store keeps its
        sections as written, and the campaign folder a copy of its text. ``budget``: budget keys
        set in place of the manifest's (``pbt run --generations 8``), recorded in the store's
        sections as :meth:`resume`'s are.

        Raises:
            ConfigError: the manifest cannot be read or breaks a rule (the message names it).
            PbtError: the directory already holds a campaign (use resume) or is not empty,
                or the rollout engines do not fit the GPUs there are.
        """
        directory = Path(directory)
        if (directory / STORE_FILENAME).exists():
            raise PbtError(
                f"{directory} already holds a campaign; continue it with: pbt resume {directory}"
            )
        if directory.exists() and any(p.name not in SUBMIT_FILES for p in directory.iterdir()):
            raise PbtError(f"{directory} is not empty; choose a new campaign directory")
        read = read_manifest_file(manifest_path)
        raw = {"manifest": read.sections, "base_dir": read.manifest.base_dir}
        manifest = read.manifest
        if budget:
            raw["manifest"] = with_budget(read.sections, budget)
            manifest = manifest_from_dict(
                raw["manifest"], raw["base_dir"], _flags(budget, "pbt run")
            )
        manifest = with_environment(manifest)  # the store keeps the sections as written
        placement = placement_for(manifest.launch, manifest.rollout.mode)  # refused: no folder
        directory.mkdir(parents=True, exist_ok=True)
        campaign = cls(directory, raw, manifest, member_command)
        campaign._placement = placement
        if placement.note:
            campaign.say(placement.note)
        campaign.store.save_config(raw)
        (directory / "manifest.yaml").write_text(read.text, encoding="utf-8")
        campaign._create_generation_zero()
        return campaign

    def _create_generation_zero(self) -> None:
        """Draw generation 0 and commit it (as generation -1's successors) with the controller's
        first RNG state. Deterministic: a start that crashed before the commit is redone."""
        rng = random.Random(self.manifest.training.seed)
        if self.manifest.search.strategy == "optuna":
            members = self._trials().first_trials()
        else:
            members = initial_records(self.manifest, study_storage(self.dir))
        events = [
            {
                "generation": 0,
                "member_id": m.member_id,
                "parent_id": None,
                "kind": "create",
                "detail": json.dumps(m.hyperparameters),
            }
            for m in members
        ]
        self.store.commit_generation(
            -1, [], members, events, _controller_state(rng, 0.0, 0.0), None
        )

    @classmethod
    def resume(
        cls,
        directory: str | Path,
        member_command: list[str] | None = None,
        budget: dict[str, Any] | None = None,
    ) -> Campaign:
        """Open an existing campaign to continue it from its last committed generation.

        Args:
            budget: budget keys to change, as totals for the whole campaign (``{"generations":
                8}``); recorded in the store. See :mod:`pbt.controller.budget`.

        Raises:
            ConfigError: a changed budget breaks a rule, is spent already, or would not give
                the decisions of a campaign planned with it (the message says which and why).
            PbtError: no campaign there, or another controller holds it.
        """
        directory = Path(directory)
        if not (directory / STORE_FILENAME).exists():
            raise PbtError(
                f"{directory} holds no campaign (no store.db); start one with: pbt run MANIFEST --dir {directory}"
            )
        with CampaignStore(directory / STORE_FILENAME) as store:
            raw = store.load_config()
        if raw is None:
            raise PbtError(
                f"{directory}/store.db has no configuration: the campaign was never created"
            )
        manifest = before = manifest_from_dict(
            raw["manifest"], base_dir=raw["base_dir"], source=str(directory / STORE_FILENAME)
        )
        if budget:
            sections = with_budget(raw["manifest"], budget)
            manifest = manifest_from_dict(sections, base_dir=raw["base_dir"], source=_flags(budget))
            raw = raw | {"manifest": sections}
        campaign = cls(directory, raw, with_environment(manifest), member_command)
        try:
            campaign._end_leftovers()
            if campaign.store.last_committed_generation() is None:
                # the start crashed before generation 0 was committed: whatever its draws left
                # in the studies is discarded, and generation 0 drawn again, the same way
                for leftover in directory.glob("optuna.db*"):
                    leftover.unlink()
                campaign._create_generation_zero()
            if budget:
                campaign._change_budget(before, budget)
        except BaseException:
            campaign.close()
            raise
        return campaign

    def _change_budget(self, before: Manifest, changes: dict[str, Any]) -> None:
        """Check the budget this campaign resumes with against what it has spent, then record
        it in the store's copy of the manifest.

        Raises:
            ConfigError: every reason it is refused, together.
        """
        last = self.store.last_committed_generation()
        ended = last >= 0 and not self.store.members(last + 1)
        problems = change_problems(before, self.manifest, changes, ended)
        if last >= 0:  # before generation 0 has trained, nothing is spent
            problems += spent_problems(self.manifest.budget, self._spent_at(last))
        if problems:
            raise ConfigError(problems, _flags(changes))
        self.store.replace_config(self.raw)

    def ended(self) -> tuple[str, str] | None:
        """``(budget key, stop reason)`` when the campaign has finished under its budget as it
        stands now; None while it has generations to train."""
        last = self.store.last_committed_generation()
        if last is None or self.store.members(last + 1):
            return None
        reached = exhausted(self.manifest.budget, self._spent_at(last))
        return reached[0] if reached else None

    def _end_leftovers(self) -> None:
        """End every process a previous controller of this campaign left running (its
        long-lived workers, its members, their ranks): nothing of it may outlive this one."""
        ended = end_campaign_processes(self.dir)
        if ended:
            self.say(f"ended {len(ended)} processes the previous controller left running")

    def close(self) -> None:
        """Stop the long-lived workers (and any process of the campaign still alive), send
        what is left to the tracking store, then release the store and the lock."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        end_campaign_processes(self.dir)
        if self._mps is not None:
            self._mps.stop()
            self._mps = None
        self.log.close()
        self.store.close()
        self._lock.close()

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> Summary:
        """Train generation after generation until the budget is spent; returns the best member.

        A campaign that has finished returns at once. One that finished under a smaller budget
        first selects its next generation, as it would have with this budget from the start.
        """
        last = self.store.last_committed_generation()
        ended = self.ended()
        if ended is not None:
            return self._summary(last, ended[1])
        state = self.store.controller_state(last)
        rng = rng_from_json(state["rng"])
        elapsed, gpu_seconds = state["elapsed_s"], state["gpu_seconds"]
        generation = last + 1
        if not self.store.members(generation):
            self._reopen(last, rng, elapsed, gpu_seconds)
        self._collect_garbage()
        self.log.started(self.dir / "manifest.yaml")
        if last >= 0:  # what followed the last commit may not have happened before a crash
            self._trials().record(last, self.store.members(last), final=False)
        while True:
            started = time.monotonic()
            guess = functools.partial(
                self._guess_next, generation, rng=rng, spent=(elapsed, gpu_seconds, started)
            )
            gpu_seconds += self._train_generation(generation, guess)
            elapsed += time.monotonic() - started
            finished = self.store.members(generation)
            best = max(finished, key=lambda m: m.fitness(self.manifest.population.fitness_window))
            reason = self._stop_reason(self._spent(generation, finished, elapsed, gpu_seconds))
            next_members, events = (
                ([], []) if reason else self._next_generation(generation, finished, rng)
            )
            best_pair = (best.member_id, best.fitness(self.manifest.population.fitness_window))
            crash_point("selection")
            self.store.commit_generation(
                generation,
                finished,
                next_members,
                events,
                _controller_state(rng, elapsed, gpu_seconds),
                best_pair,
            )
            crash_point("commit")
            self.log.generation_committed(generation, finished)
            self._trials().record(generation, finished, final=bool(reason))
            self.say(
                f"generation {generation} committed: best {best.member_id} fitness {best_pair[1]:.3f}"
            )
            self._collect_garbage()
            if reason:
                summary = self._summary(generation, reason)
                best = summary.best_checkpoint
                self.log.finished(self._checkpoint_path(best, "best checkpoint") if best else None)
                return summary
            generation += 1

    def _summary(self, generation: int, reason: str) -> Summary:
        """How the campaign ended after ``generation``: its best member of all generations."""
        member, fitness = self.store.best()
        checkpoint = self.store.member(member).checkpoint or ""
        return Summary(generation + 1, member, fitness, checkpoint, reason)

    def _reopen(self, last: int, rng: random.Random, elapsed: float, gpu_seconds: float) -> None:
        """The campaign ended after generation ``last`` and its budget has since been raised:
        select and mutate ``last``'s successors from the RNG state committed with it (the one
        that selection would have used) and commit them with it."""
        members, events = self._next_generation(last, self.store.members(last), rng)
        state = _controller_state(rng, elapsed, gpu_seconds)
        self.store.reopen_generation(last, members, events, state)
        self.say(f"generation {last + 1} selected: the budget now allows it")

    def _spent_at(self, generation: int) -> Spent:
        """What the campaign had used when ``generation`` was committed."""
        state = self.store.controller_state(generation)
        finished = self.store.members(generation)
        return self._spent(generation, finished, state["elapsed_s"], state["gpu_seconds"])

    def _next_generation(
        self,
        generation: int,
        finished: list[MemberRecord],
        rng: random.Random,
        members: list[MemberRecord] | None = None,
    ):
        """``generation``'s successors and the selection events; ``members`` stands for the
        store's members of every generation (a guess made before they are recorded)."""
        if self.manifest.search.strategy == "optuna":
            return self._trials().next_trials(generation, finished)
        selected = self.selection.select(finished, rng)
        explore = self.mutations
        if self.manifest.search.strategy == "pb2":
            members = self.store.members() if members is None else members
            explore = build_pb2(self.manifest, members, generation)
        members = breed(selected, generation + 1, explore, rng)
        return members, selection_events(selected, members)

    def _trials(self) -> Trials:
        return Trials(self.manifest, self.store, self.dir)

    def _stop_reason(self, spent: Spent) -> str:
        reached = exhausted(self.manifest.budget, spent)
        return reached[0][1] if reached else ""

    def _spent(
        self,
        generation: int,
        finished: list[MemberRecord],
        elapsed: float,
        gpu_seconds: float,
        members: list[MemberRecord] | None = None,
    ) -> Spent:
        """What the campaign has used once ``generation`` (its members ``finished``) is done;
        ``members`` stands for the store's (see :meth:`_next_generation`)."""
        members = self.store.members() if members is None else members
        return spent_by(self.manifest, members, generation, finished, elapsed, gpu_seconds)

    # -- one generation --------------------------------------------------------------------

    def _guess_next(
        self,
        generation: int,
        results: dict[str, ResultMessage],
        rng: random.Random,
        spent: tuple[float, float, float],
    ) -> list[TaskSpec]:
        """The next generation's first tasks, chosen from ``generation``'s ``results`` while
        its last checkpoints are still being written: the launcher starts them on the idle
        workers at once, so that the writes overlap training (:mod:`pbt.launch.handahead`).

        Nothing is recorded: the generation is committed as always, once every checkpoint is
        on disk, with selection run again from the committed records and the same RNG state;
        the launcher keeps a task started here only if the committed one is the same task, so
        a guess that does not hold (a write that failed, a budget reached meanwhile) costs the
        work started on it, never a decision. A member whose parent checkpoint is still being
        written is handed with a null ``parent_digest``, to the worker writing it alone (see
        :meth:`HandAhead.hand <pbt.launch.handahead.HandAhead.hand>`), which loads that state
        from memory. Optuna's trials are not guessed: asking the study records them.
        ``spent``: the campaign's elapsed and GPU seconds before ``generation``, and when
        ``generation`` started (``time.monotonic()``).
        """
        if self.manifest.search.strategy == "optuna":
            return []
        members = [
            applied(replace(m), results[m.member_id]) if m.member_id in results else m
            for m in self.store.members()
        ]
        finished = [m for m in members if m.generation == generation]
        elapsed, gpu_seconds, started = spent
        elapsed += time.monotonic() - started
        if self._stop_reason(self._spent(generation, finished, elapsed, gpu_seconds, members)):
            return []
        guessed = random.Random()
        guessed.setstate(rng.getstate())
        successors, _ = self._next_generation(generation, finished, guessed, members)
        written = {r.checkpoint: r.digest for r in results.values() if r.digest}
        in_flight = {r.checkpoint for r in results.values() if not r.digest}
        tasks = []
        for m in successors:
            parent = m.parent_checkpoint
            digest = written.get(parent) if parent else None
            if parent and digest is None:
                digest = self.store.checkpoint_digest(parent)
            if digest is not None or (parent in in_flight and self.manifest.launch.ranks == 1):
                # a null parent_digest: the worker writing the parent loads it from memory
                tasks.append(self._task(replace(m, attempts=m.attempts + 1), digest))
        return tasks

    def _train_generation(
        self,
        generation: int,
        guess: Callable[[dict[str, ResultMessage]], list[TaskSpec]] | None = None,
    ) -> float:
        """Train every unfinished member of ``generation``, retrying and replacing those that
        fail; returns GPU-seconds used. ``guess`` (:meth:`_guess_next`) is asked for the next
        generation's first tasks once every member's result is known."""
        launch = self.manifest.launch
        gpu_seconds = 0.0
        pending = [m for m in self.store.members(generation) if m.status != "done"]
        total = len(self.store.members(generation))
        launcher = self._launcher()
        adopted = self._adopt_jobs(pending, launcher)
        # a member a previous controller left running goes on with its attempt: its job
        # adopted, or its process ended above and the attempt run again (a crash of the
        # controller costs no member a retry)
        carried = {m.member_id for m in pending if m.status == "running" and m.attempts}
        self.say(f"generation {generation}: training {len(pending)} of {total} members")
        self.log.members_started(pending)
        attempts: dict[str, int] = {}
        display = self._progress(generation, launcher.slots)

        def started(task: TaskSpec, _slot: int) -> None:
            if task.adopt is None:
                job = launcher.started[task.task_id]
                self.store.record_launch(task.task_id, attempts[task.task_id], launch.backend, job)
            crash_point("task")

        while pending:
            for m in pending:
                if m.member_id not in carried:
                    m.attempts += 1
                m.status = "running"
                self.store.update_member(m)
            crash_point("launch")
            tasks = [self._task(m, adopt=adopted.pop(m.member_id, None)) for m in pending]
            attempts.update({m.member_id: m.attempts for m in pending})
            with display:  # its bars end with the round, before the members' lines
                outcomes = launcher.run(
                    tasks, on_start=started, on_poll=display.poll, on_released=guess
                )
            if launcher.kept_ahead:
                self.say(
                    f"  {', '.join(launcher.kept_ahead)} started while generation "
                    f"{generation - 1}'s last checkpoints were written"
                )
            for outcome in outcomes:
                gpus = launch.gpus_per_member + self._engine_placement().engine_gpus_per_member
                gpu_seconds += outcome.seconds * gpus
            pending = self._settle(generation, pending, outcomes)
            carried = set()
        return gpu_seconds

    def _adopt_jobs(self, pending: list[MemberRecord], launcher: LocalLauncher) -> dict[str, str]:
        """The jobs a crashed controller left running for ``pending`` members, to watch rather
        than start again (Slurm); whatever else it left is ended, so nothing races a retry."""
        adopted = {}
        for m in pending:
            if m.status == "running":
                job = launcher.take_over(self.dir / "tasks" / m.member_id)
                if job is not None:
                    adopted[m.member_id] = job
                    self.say(
                        f"  {m.member_id}: adopting job {job}, left by the previous controller"
                    )
        return adopted

    def _settle(
        self, generation: int, pending: list[MemberRecord], outcomes: list[Outcome]
    ) -> list[MemberRecord]:
        """Record each attempt's outcome; the members to retry. After its last attempt a
        member is replaced (:class:`~pbt.controller.outcomes.Outcomes`), after every success
        of the round, since each may be the clone's source; a full disk stops the campaign."""
        launch = self.manifest.launch
        retry, disk_full, lost = [], None, []
        for m, outcome in zip(pending, outcomes, strict=True):
            outcome = self.outcomes.check_result(m, outcome)
            if outcome.status == "ok":
                self.outcomes.succeeded(m, outcome)
            elif m.attempts < launch.max_attempts and outcome.status not in NOT_RETRIED:
                self.outcomes.failed(m, outcome, "retrying")
                retry.append(m)
            elif outcome.status == "disk_full":
                self.outcomes.failed(m, outcome, "stopping the campaign")
                disk_full = disk_full or (m, outcome)
            else:
                self.outcomes.failed(m, outcome, "replacing")
                lost.append((m, outcome))
        for m, outcome in lost:
            self.outcomes.replace(m, generation, outcome)
        if disk_full is not None:
            self.outcomes.stop_for_disk(*disk_full)
        return retry

    def _progress(self, generation: int, slots: int) -> ProgressDisplay:
        """What shows ``generation``'s members as they train (:mod:`pbt.controller.progress`);
        the mean generation time so far is the store's."""
        mean = None
        if generation > 0:
            mean = self.store.controller_state(generation - 1)["elapsed_s"] / generation
        plan = Plan(generation, self.manifest.budget.generations, slots, mean)
        return ProgressDisplay(plan, say=self.say, every_s=self.manifest.tracking.progress_every_s)

    def _task(
        self, m: MemberRecord, parent_digest: str | None = None, adopt: str | None = None
    ) -> TaskSpec:
        """Write ``m``'s task (:func:`pbt.controller.task_files.write_task`)."""
        plain_name(m.member_id, f"a member id in {self.store.path}")
        if m.parent_checkpoint:
            self._checkpoint_path(m.parent_checkpoint, f"the parent checkpoint of {m.member_id}")
        return write_task(self.dir, self.manifest, self.store, m, parent_digest, adopt)

    def _launcher(self) -> LocalLauncher:
        """A launcher per generation; with ``persistent_workers`` one for the whole campaign,
        whose workers outlive each generation."""
        if self.manifest.launch.persistent_workers:
            if self._workers is None:
                self._workers = self._new_launcher()
            return self._workers
        return self._new_launcher()

    def _new_launcher(self) -> LocalLauncher:
        """The launcher ``launch`` asks for (:mod:`pbt.launch.build`), with this campaign's
        MPS daemon when members share GPUs under MPS, and its hand-ahead."""
        launch = self.manifest.launch
        env = member_env(launch)
        placement = self._engine_placement()
        shared = launch.members_per_gpu > 1 or placement.kind == "shared"
        if shared and launch.gpus_per_member and launch.mps:
            if self._mps is None:
                self._mps = MpsDaemon().start()
                self.say(self._mps.note)
            env.update(self._mps.env)
        return build_launcher(
            launch, self.dir, self.member_command, env, self.hand_ahead, placement,
            self.manifest.worker_batch,
        )  # fmt: skip

    def _engine_placement(self) -> Placement:
        """Where the members' rollout engines run (:mod:`pbt.launch.placement`), decided once
        and said in the log."""
        if self._placement is None:
            self._placement = placement_for(self.manifest.launch, self.manifest.rollout.mode)
            if self._placement.note:
                self.say(self._placement.note)
        return self._placement

    def _checkpoint_path(self, path: str, what: str) -> Path:
        """Where checkpoint ``path`` (relative to the campaign, from the store) lies on disk.

        Raises:
            PbtError: it would lie outside ``<campaign>/checkpoints``.
        """
        return inside(self.dir, path, "checkpoints", what)

    def _collect_garbage(self) -> None:
        """Delete what nothing references (:mod:`pbt.controller.garbage`), leaving alone the
        writes of the tasks handed ahead."""
        collect_garbage(self.dir, self.store, self.hand_ahead.handed(), self.say)


def _say(line: str) -> None:
    """The controller's output: flushed, so a log shows each line as it happens."""
    print(line, flush=True)


SUBMIT_FILES = frozenset({"controller.sbatch", "controller.log"})
"""What ``pbt submit`` puts in a campaign folder before its controller job creates the campaign."""


def _flags(changes: dict[str, Any], command: str = "pbt resume") -> str:
    """The ``pbt resume`` (or ``command``'s) flags that ask for ``changes``, for messages."""
    return f"{command} " + " ".join(f"{FLAGS.get(k, k)} {v}" for k, v in changes.items())


def _controller_state(rng: random.Random, elapsed: float, gpu_seconds: float) -> dict[str, Any]:
    return {
        "rng": rng_to_json(rng),
        "elapsed_s": elapsed,
        "gpu_seconds": gpu_seconds,
    }
