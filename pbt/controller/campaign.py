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
form (:mod:`pbt.config.canonical`), translated and validated once, here. This module imports no
torch: members are separate processes.

The controller writes, loads and deletes only inside its directory: a member id, or a checkpoint
path from the store or from a member's result, that would lead elsewhere (``..``, an absolute
path, a symlink) is refused (:mod:`pbt.protocol.paths`). A member that cannot write its checkpoint
because the disk is full stops the campaign after its last attempt, rather than being replaced
by clones that would fail the same way: free space, then ``pbt resume``.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pbt.config import Manifest
from pbt.config.canonical import canonical_sections
from pbt.config.errors import ConfigError, PbtError
from pbt.config.loader import manifest_from_dict, read_manifest_file
from pbt.controller.budget import (
    FLAGS,
    Spent,
    change_problems,
    exhausted,
    spent_problems,
    with_budget,
)
from pbt.controller.campaign_log import CampaignLog
from pbt.controller.lock import ControllerLock
from pbt.controller.progress import Plan, ProgressDisplay, every_s_from_env
from pbt.controller.store import STORE_FILENAME, CampaignStore
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
from pbt.launch import slurm
from pbt.launch.local import LocalLauncher, Outcome, TaskSpec, member_command
from pbt.launch.mps import MpsDaemon
from pbt.launch.persistent import PersistentLauncher
from pbt.launch.processes import end_campaign_processes
from pbt.protocol.collapse import COLLAPSED, diagnosis, last_zero_signal, signal_note
from pbt.protocol.crash import crash_point
from pbt.protocol.faults import NOT_RETRIED
from pbt.protocol.messages import TASK_FILE, ResultMessage, TaskMessage
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
        self.manifest = manifest  # raw, validated once by start or resume
        self.say = _say
        self._lock = ControllerLock.acquire(directory, say=self.say)
        self.store = CampaignStore(directory / STORE_FILENAME)
        self.selection = build_selection(self.manifest)
        self.mutations = build_mutations(self.manifest)
        self.member_command = member_command
        self.log = CampaignLog(directory, self.manifest)
        self._workers: PersistentLauncher | None = None
        self._mps: MpsDaemon | None = None

    # -- creation and resume ---------------------------------------------------------------

    @classmethod
    def start(
        cls,
        manifest_path: str | Path,
        directory: str | Path,
        member_command: list[str] | None = None,
    ) -> Campaign:
        """Create ``directory`` as a new campaign from a manifest file and build generation 0.

        The file is read and validated once, before anything is created; the store keeps its
        sections as written, and the campaign folder a copy of its text.

        Raises:
            ConfigError: the manifest cannot be read or breaks a rule (the message names it).
            PbtError: the directory already holds a campaign (use resume) or is not empty.
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
        directory.mkdir(parents=True, exist_ok=True)
        campaign = cls(directory, raw, read.manifest, member_command)
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
        campaign = cls(directory, raw, manifest, member_command)
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
        # each member that trained (not one replaced by a clone) trained evo_steps steps, or
        # fewer when it collapsed; its own step count is its lineage's, parents' steps included
        evo_steps = self.manifest.population.evo_steps
        total_steps = sum(
            int(m.metrics.get("trained_steps", evo_steps))
            for m in (self.store.members() if members is None else members)
            if m.status == "done"
            and m.generation <= generation
            and not (m.mutation or "").startswith("replaced")
        )
        window = self.manifest.population.fitness_window
        return Spent(
            generations=generation + 1,
            total_steps=total_steps,
            wall_time_s=elapsed,
            gpu_hours=gpu_seconds / 3600,
            best_fitness=max(m.fitness(window) for m in finished),
        )

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
        workers at once, so that the writes overlap training.

        Nothing is recorded: the generation is committed as always, once every checkpoint is
        on disk, with selection run again from the committed records and the same RNG state;
        the launcher keeps a task started here only if the committed one is the same task, so
        a guess that does not hold (a write that failed, a budget reached meanwhile) costs the
        work started on it, never a decision. A member whose parent checkpoint is still being
        written is handed with a null ``parent_digest``, to the worker writing it alone (see
        :meth:`LocalLauncher._hand_next`), which loads that state from memory. Optuna's trials
        are not guessed: asking the study records them.
        ``spent``: the campaign's elapsed and GPU seconds before ``generation``, and when
        ``generation`` started (``time.monotonic()``).
        """
        if self.manifest.search.strategy == "optuna":
            return []
        members = [
            self._applied(replace(m), results[m.member_id]) if m.member_id in results else m
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
        """Train every unfinished member of ``generation``; returns GPU-seconds used.
        ``guess`` (:meth:`_guess_next`) is asked for the next generation's first tasks once
        every member's result is known."""
        launch = self.manifest.launch
        gpu_seconds = 0.0
        pending = [m for m in self.store.members(generation) if m.status != "done"]
        total = len(self.store.members(generation))
        launcher, backend = self._launcher(), launch.backend
        adopted: dict[str, str] = {}
        for m in pending:  # what a crashed controller left running must not race its retry
            if m.status == "running":
                job = launcher.take_over(self.dir / "tasks" / m.member_id)
                if job is not None:
                    adopted[m.member_id] = job
                    self.say(
                        f"  {m.member_id}: adopting job {job}, left by the previous controller"
                    )
        self.say(f"generation {generation}: training {len(pending)} of {total} members")
        self.log.members_started(pending)
        attempts: dict[str, int] = {}
        display = self._progress(generation, launcher.slots)

        def started(task: TaskSpec, _slot: int) -> None:
            if task.adopt is None:
                job = launcher.started[task.task_id]
                self.store.record_launch(task.task_id, attempts[task.task_id], backend, job)
            crash_point("task")

        while pending:
            for m in pending:
                if m.member_id not in adopted:
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
            retry, disk_full, lost = [], None, []
            for m, outcome in zip(pending, outcomes, strict=True):
                gpu_seconds += outcome.seconds * launch.gpus_per_member
                outcome = self._check_result(m, outcome)
                if outcome.status == "ok":
                    self._record_success(m, outcome)
                elif m.attempts < launch.max_attempts and outcome.status not in NOT_RETRIED:
                    self._record_fault(m, outcome, "retrying")
                    retry.append(m)
                elif outcome.status == "disk_full":
                    self._record_fault(m, outcome, "stopping the campaign")
                    disk_full = disk_full or (m, outcome)
                else:
                    self._record_fault(m, outcome, "replacing")
                    lost.append((m, outcome))
            for m, outcome in lost:  # after every success of the round: each may be a source
                self._replace(m, generation, outcome)
            if disk_full is not None:
                self._stop_for_disk(*disk_full)
            pending = retry
        return gpu_seconds

    def _progress(self, generation: int, slots: int) -> ProgressDisplay:
        """What shows ``generation``'s members as they train (:mod:`pbt.controller.progress`);
        the mean generation time so far is the store's."""
        mean = None
        if generation > 0:
            mean = self.store.controller_state(generation - 1)["elapsed_s"] / generation
        plan = Plan(generation, self.manifest.budget.generations, slots, mean)
        return ProgressDisplay(plan, say=self.say, every_s=every_s_from_env())

    def _stop_for_disk(self, m: MemberRecord, outcome: Outcome) -> None:
        """A full disk is not the member's fault: clones would fail the same way. Stop, with
        the generation uncommitted, so that a resume re-runs what did not finish."""
        reason = outcome.detail.splitlines()[0] if outcome.detail else "the disk is full"
        raise PbtError(
            f"{m.member_id} failed {m.attempts} times for want of disk space ({reason}); the "
            f"campaign stopped with generation {m.generation} uncommitted and every earlier "
            f"checkpoint intact: free space on the disk that holds {self.dir}, then continue "
            f"with: pbt resume {self.dir}"
        )

    def _check_result(self, m: MemberRecord, outcome: Outcome) -> Outcome:
        """A result whose checkpoint is not the one its task named is a bad result: the
        controller would load and later delete whatever path it gives."""
        if outcome.status != "ok":
            return outcome
        named = outcome.result.checkpoint if outcome.result is not None else None
        if named == f"checkpoints/{m.member_id}":
            return outcome
        detail = f"result.json names checkpoint {named!r}, not its task's checkpoints/{m.member_id}"
        return replace(outcome, status="bad_result", detail=detail)

    def _task(
        self, m: MemberRecord, parent_digest: str | None = None, adopt: str | None = None
    ) -> TaskSpec:
        plain_name(m.member_id, f"a member id in {self.store.path}")
        if m.parent_checkpoint:
            self._checkpoint_path(m.parent_checkpoint, f"the parent checkpoint of {m.member_id}")
        task_dir = self.dir / "tasks" / m.member_id
        task_dir.mkdir(parents=True, exist_ok=True)
        parent_digest = (
            parent_digest or self.store.checkpoint_digest(m.parent_checkpoint)
            if m.parent_checkpoint
            else None
        )
        TaskMessage(
            campaign_dir=str(self.dir.resolve()),
            manifest=self._member_sections(),
            manifest_base_dir=self.manifest.base_dir,
            member_id=m.member_id,
            generation=m.generation,
            parent_id=m.parent_id,
            parent_checkpoint=m.parent_checkpoint,
            parent_digest=parent_digest,
            hyperparameters=m.hyperparameters,
            mutation=m.mutation,
            steps=self.manifest.population.evo_steps,
            checkpoint=f"checkpoints/{m.member_id}",
        ).write(task_dir / TASK_FILE)
        log = self.dir / "logs" / f"{m.member_id}.attempt{m.attempts}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        nproc = self.manifest.launch.ranks
        return TaskSpec(m.member_id, task_dir, log_path=log, nproc=nproc, adopt=adopt)

    def _member_sections(self) -> dict[str, Any]:
        """The manifest members train by, in canonical form (translated and validated once, by
        this controller; a member translates nothing): the campaign's, with a schedule that
        spans the whole campaign, not one generation."""
        steps = self.manifest.budget.generations * self.manifest.population.evo_steps
        training = replace(self.manifest.training, steps=steps)
        return canonical_sections(replace(self.manifest, training=training))

    def _launcher(self) -> LocalLauncher:
        """A launcher per generation; with ``persistent_workers`` one for the whole campaign,
        whose workers outlive each generation."""
        if self.manifest.launch.persistent_workers:
            if self._workers is None:
                self._workers = self._new_launcher()
            return self._workers
        return self._new_launcher()

    def _new_launcher(self) -> LocalLauncher:
        launch = self.manifest.launch
        command = self.member_command or member_command()
        env = {}
        if launch.gpus_per_member == 0 and "OMP_NUM_THREADS" not in os.environ:
            # CPU members share the cores: oversubscribed threads slow every member down
            env["OMP_NUM_THREADS"] = str(
                max(1, (os.cpu_count() or 1) // (launch.slots * launch.ranks))
            )
        if launch.members_per_gpu > 1 and launch.gpus_per_member and launch.mps:
            if self._mps is None:
                self._mps = MpsDaemon().start()
                self.say(self._mps.note)
            env.update(self._mps.env)
        kind, extra = LocalLauncher, {}
        if launch.persistent_workers:
            kind, extra = PersistentLauncher, {"workers_dir": self.dir / "workers"}
        if launch.backend == "slurm":
            command = self.member_command or slurm.slurm_member_command()
            kind = (
                slurm.SlurmPersistentLauncher if launch.persistent_workers else slurm.SlurmLauncher
            )
            extra |= {"slurm": launch.slurm, "name": f"pbt-{self.dir.resolve().name}"}
        return kind(
            command,
            **extra,
            slots=launch.slots,
            gpus_per_member=launch.gpus_per_member,
            gpu_ids=launch.gpu_ids,
            members_per_gpu=launch.members_per_gpu,
            heartbeat_timeout_s=launch.heartbeat_timeout_s,
            task_timeout_s=launch.task_timeout_s,
            env=env,
            campaign_dir=self.dir,
            memory_limit_bytes=(
                None if launch.memory_limit_gib is None else int(launch.memory_limit_gib * 2**30)
            ),
        )

    @staticmethod
    def _applied(m: MemberRecord, result: ResultMessage) -> MemberRecord:
        """``m`` (changed in place) as its task's ``result`` leaves it: done, with its fitness."""
        trained = result.steps - m.steps  # m.steps: its parent's, until now
        m.status = "done"
        m.checkpoint = result.checkpoint
        m.checkpoint_digest = result.digest
        m.fitness_history = [*m.fitness_history, float(result.fitness)]
        m.steps = result.steps
        m.collapsed = result.fault is not None and result.fault.kind == COLLAPSED
        m.metrics = _signal_figures(result.metrics) | {"trained_steps": trained}
        return m

    def _record_success(self, m: MemberRecord, outcome: Outcome) -> None:
        result = outcome.result
        assert result is not None  # an ok outcome has its result
        self._applied(m, result)
        trained = int(m.metrics["trained_steps"])
        self.store.register_checkpoint(m.checkpoint, m.checkpoint_digest or "")
        self.store.update_member(m)
        if m.collapsed:
            detail = result.fault.detail if result.fault is not None else ""
            self.store.record_fault(m.generation, m.member_id, m.attempts, COLLAPSED, detail)
        self.log.member_finished(m, result)
        how = (
            f"collapsed after {trained} of {self.manifest.population.evo_steps} steps"
            if m.collapsed
            else "done"
        )
        self.say(
            f"  {m.member_id} {how}: fitness {result.fitness:.3f} ({m.mutation or 'initial'}) "
            f"in {outcome.seconds:.0f} s{signal_note(m.metrics)}"
        )
        self._diagnose(m, result.history)

    def _diagnose(self, m: MemberRecord, history: list[dict[str, float]]) -> None:
        """Say once, for a member with a step that learned nothing, why and what to change."""
        step = last_zero_signal(history)
        if step is not None:
            self.say(f"  {m.member_id} had no signal at step {step['step']:.0f}: {diagnosis(step)}")
        if m.collapsed:
            self.say(f"  {m.member_id} collapsed; selection replaces it")

    def _record_fault(self, m: MemberRecord, outcome: Outcome, action: str) -> None:
        self.store.record_fault(
            m.generation, m.member_id, m.attempts, outcome.status, outcome.detail
        )
        m.status = "failed"
        self.store.update_member(m)
        self.log.member_failed(m, outcome.status, outcome.detail, final=action == "replacing")
        reason = outcome.detail.splitlines()[0] if outcome.detail else ""
        log = self.dir / "logs" / f"{m.member_id}.attempt{m.attempts}.log"
        of = f"attempt {m.attempts} of {self.manifest.launch.max_attempts}"
        self.say(f"  {m.member_id} {outcome.status} ({of}): {reason}; {action} (log: {log})")

    def _replace(self, m: MemberRecord, generation: int, outcome: Outcome) -> None:
        """After its last failed attempt (its first, on a configuration error or a broken
        parent checkpoint, which would fail again the same way), a member becomes a clone of
        the generation's best finished member, or of its own parent (unless that is broken)
        when none has finished; with neither, the campaign stops with the member's cause."""
        done = [x for x in self.store.members(generation) if x.status == "done"]
        window = self.manifest.population.fitness_window
        if done:
            source = max(done, key=lambda x: x.fitness(window))
            m.checkpoint, m.checkpoint_digest = source.checkpoint, source.checkpoint_digest
            m.fitness_history, m.steps = list(source.fitness_history), source.steps
            m.hyperparameters = dict(source.hyperparameters)
            detail = f"replaced by a clone of {source.member_id} after {m.attempts} failed attempts"
        elif m.parent_checkpoint and outcome.status != "bad_checkpoint":
            m.checkpoint = m.parent_checkpoint
            detail = f"replaced by its parent {m.parent_id} after {m.attempts} failed attempts"
        else:
            raise PbtError(self._nothing_to_replace(m, generation, outcome))
        m.status, m.mutation = "done", detail
        self.store.update_member(m)
        self.store.record_fault(generation, m.member_id, m.attempts, "replaced", detail)
        self.say(f"  {m.member_id} {detail}")

    def _nothing_to_replace(self, m: MemberRecord, generation: int, outcome: Outcome) -> str:
        """Why the campaign stops: the member's cause first, then what it means."""
        cause = outcome.detail.splitlines()[0] if outcome.detail else outcome.status
        times = "once" if m.attempts == 1 else f"{m.attempts} times"
        log = self.dir / "logs" / f"{m.member_id}.attempt{m.attempts}.log"
        fix = f"see {log}"
        if outcome.status in ("config_error", "reward_error"):
            fix = (
                "fix the manifest or its reward and start the campaign again (pbt check "
                "MANIFEST first)"
            )
        if outcome.status == "bad_checkpoint":
            fix = f"restore {m.parent_checkpoint} from a backup, or start the campaign again"
        return (
            f"{m.member_id} failed {times} ({outcome.status}: {cause}) and no member of "
            f"generation {generation} finished to replace it; {fix}"
        )

    def _checkpoint_path(self, path: str, what: str) -> Path:
        """Where checkpoint ``path`` (relative to the campaign, from the store) lies on disk.

        Raises:
            PbtError: it would lie outside ``<campaign>/checkpoints``.
        """
        return inside(self.dir, path, "checkpoints", what)

    def _collect_garbage(self) -> None:
        """Delete checkpoints nothing references any more, and what writes that were cut off
        left behind (disk stays bounded). No member runs while this does but the next
        generation's members started ahead (:meth:`_guess_next`), whose checkpoints may be
        being written: their temporary folders are left alone. A recorded path that leads
        outside the checkpoints folder is forgotten, its target left alone."""
        writing = set() if self._workers is None else self._workers.handed_ahead()
        for path in self.store.unreferenced_checkpoints():
            try:
                self._checkpoint_path(path, "an unreferenced checkpoint")
            except PbtError as err:
                self.say(f"  not deleting it: {err}")
            else:
                _remove(self.dir / path)
            crash_point("gc")
            self.store.forget_checkpoint(path)
        folder = self.dir / "checkpoints"
        if folder.is_dir() and not folder.is_symlink():
            for leftover in folder.glob(".*"):
                name = leftover.name[1:].partition(".tmp-")[0].partition(".old-")[0]
                if name != leftover.name[1:] and name not in writing:
                    _remove(leftover)


def _say(line: str) -> None:
    """The controller's output: flushed, so a log shows each line as it happens."""
    print(line, flush=True)


def _signal_figures(metrics: dict[str, Any]) -> dict[str, float]:
    """The zero-signal figures of a result's metrics, for the member's record."""
    keys = ("zero_signal_fraction", "zero_signal_fraction_mean", "zero_signal_steps")
    return {k: float(metrics[k]) for k in keys if k in metrics}


def _remove(path: Path) -> None:
    """Delete a checkpoint folder; a symlink is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


SUBMIT_FILES = frozenset({"controller.sbatch", "controller.log"})
"""What ``pbt submit`` puts in a campaign folder before its controller job creates the campaign."""


def _flags(changes: dict[str, Any]) -> str:
    """The ``pbt resume`` flags that ask for ``changes``, for messages."""
    return "pbt resume " + " ".join(f"{FLAGS.get(k, k)} {v}" for k, v in changes.items())


def _controller_state(rng: random.Random, elapsed: float, gpu_seconds: float) -> dict[str, Any]:
    return {
        "rng": rng_to_json(rng),
        "elapsed_s": elapsed,
        "gpu_seconds": gpu_seconds,
    }
