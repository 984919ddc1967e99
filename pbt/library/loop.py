"""A ready training loop for a library-mode population: train, evaluate, evolve, checkpoint.

    pop = create_population(algo="GRPO", INIT_HP=INIT_HP, population_size=4)
    pop = train_population(pop, steps=40, evo_steps=10, eval_every=5, output_dir="runs/lib")

Every member trains the same number of steps, in turns, on the shared base model, except one
that collapses (no signal for ``algorithm.collapse_patience`` steps in a row): it stops
training, is still evaluated, and the next evolution replaces it. Members are
evaluated every ``eval_every`` steps, and always at an evolution step before selection, so
selection never ranks a member by an evaluation older than its training; evolution (tournament
selection, then mutation) happens every ``evo_steps`` steps, but not after the last one.

After every evolution and at the end, each member is saved as a standard checkpoint under
``output_dir/checkpoints`` and ``output_dir/population.json`` is replaced atomically, last:
called again on the same ``output_dir``, the loop resumes from there and makes exactly the
decisions an uninterrupted run would have made. Metrics go to MLflow (an embedded SQLite store
in ``output_dir`` unless ``tracking`` names a server); only rank 0 writes files or logs.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from pbt.config.errors import ConfigError, PbtError
from pbt.library.population import Agent, Population
from pbt.protocol.files import read_json, write_json_atomic
from pbt.protocol.paths import inside, plain_name
from pbt.protocol.records import MemberRecord, rng_from_json, rng_to_json
from pbt.tracking.run_schema import (
    POPULATION_RUN,
    population_experiment,
    start_members,
    start_parent,
)
from pbt.tracking.tracker import Tracker, default_uri

STATE_FILE = "population.json"
STATE_VERSION = 1


def train_population(
    population: Population,
    *,
    steps: int | None = None,
    evo_steps: int | None = None,
    eval_every: int | None = None,
    output_dir: str | Path | None = None,
    resume: bool = True,
    tracking: bool | str = True,
    target_fitness: float | None = None,
    progress: bool = True,
    tournament=None,
    mutations=None,
) -> Population:
    """Train ``population`` for ``steps`` steps per member, evolving it on the way.

    Args:
        population: from :func:`pbt.create_population` or ``GRPO.population(...)``.
        steps: training steps per member in all (default ``training.steps``).
        evo_steps: steps between evolutions (default ``population.evo_steps``).
        eval_every: steps between evaluations (default ``training.eval_every``, or ``evo_steps``
            when that is 0).
        output_dir: checkpoints, state and the embedded MLflow store (default
            ``training.output_dir``).
        resume: continue from ``output_dir`` when it holds a saved population.
        tracking: True for the embedded MLflow store, a tracking URI for a server, False off.
        target_fitness: stop early once the best member's latest fitness reaches it.
        progress: print a line per member per evaluation and per evolution, and on a terminal
            a progress bar while a member trains.
        tournament, mutations: the selection and mutation to evolve with (default the
            population's own, as configured); see :meth:`Population.evolve`.

    Returns:
        The population (the same object), evaluated at its last step.

    Raises:
        ConfigError: a bad interval, or an ``output_dir`` saved by another configuration.
    """
    manifest = population.manifest
    steps = manifest.training.steps if steps is None else steps
    evo_steps = manifest.population.evo_steps if evo_steps is None else evo_steps
    if eval_every is None:
        eval_every = manifest.training.eval_every or evo_steps
    _check_intervals(steps, evo_steps, eval_every)
    out = Path(output_dir or manifest.training.output_dir)
    run = _Run(population, out, progress, tracking)
    run.evolution = (tournament, mutations)
    if resume:
        run.restore()
    try:
        run.loop(steps, evo_steps, eval_every, target_fitness)
    finally:
        run.close()
    return population


def _check_intervals(steps: int, evo_steps: int, eval_every: int) -> None:
    problems = []
    for key, value in (("steps", steps), ("evo_steps", evo_steps), ("eval_every", eval_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key} ({value!r}) must be an integer >= 1; set {key} to 1 or more")
    if problems:
        raise ConfigError(problems)


class _Run:
    """The state of one ``train_population`` call."""

    def __init__(self, pop: Population, out: Path, progress: bool, tracking: bool | str) -> None:
        from pbt.distributed.process_group import world_info

        self.pop = pop
        self.out = out
        self.progress = progress
        self.rank = world_info().rank
        self.step = min((agent.steps for agent in pop), default=0)
        self.evaluated_at = -1
        self.evolved_at = -1
        self.saved_at = -1
        self.tracker = None
        self.evolution: tuple = (None, None)
        self.started = time.perf_counter()
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if tracking:
                self.tracker = _tracker(out, tracking)

    # -- the loop --------------------------------------------------------------------------

    def loop(self, steps: int, evo_steps: int, eval_every: int, target: float | None) -> None:
        self._start_runs()
        while True:
            due_evolution = self.step % evo_steps == 0 and 0 < self.step < steps
            due_evaluation = self.step >= steps or self.step % eval_every == 0 or due_evolution
            if due_evaluation and self.step > 0 and self.evaluated_at != self.step:
                self.evaluate()
            if self.step >= steps or self._reached(target):
                break
            if due_evolution and self.evolved_at != self.step:
                self.evolve()
                self.save()
            boundary = min(
                steps, _next_multiple(self.step, eval_every), _next_multiple(self.step, evo_steps)
            )
            self.train(boundary - self.step)
        if self.saved_at != self.step:
            self.save()

    def train(self, count: int) -> None:
        for agent in self.pop:
            if agent.stopped:  # ended for lack of signal: it waits for selection to replace it
                continue
            started = time.perf_counter()
            bar = self._bar(agent.member_id, count)

            def log(
                step: int, metrics: dict[str, float], agent: Agent = agent, bar: tqdm = bar
            ) -> None:
                self._log(agent, metrics, step)
                bar.set_postfix_str(_bar_words(metrics), refresh=False)
                bar.update()

            def say(line: str, agent: Agent = agent) -> None:
                self._say(f"  {agent.member_id} {line}")

            with bar:
                history = agent.train(count, log, say)
            ended = ", collapsed: it trains no more" if agent.stopped else ""
            self._say(
                f"  {agent.member_id} step {agent.steps}: {agent.describe(history[-1])} "
                f"({time.perf_counter() - started:.1f} s){ended}"
            )
        self.step += count

    def evaluate(self) -> None:
        for agent in self.pop:
            fitness = agent.test()
            evaluated = {"fitness": fitness, "collapsed": float(agent.collapsed)}
            self._log(agent, evaluated | agent.hyperparameters, self.step)
        best = max(self.pop, key=lambda a: a.fitness[-1])
        mean = sum(a.fitness[-1] for a in self.pop) / len(self.pop)
        self._say(
            f"step {self.step} generation {self.pop.generation}: best {best.member_id} "
            f"fitness {best.fitness[-1]:.4f}, mean {mean:.4f}"
        )
        if self.tracker is not None:
            self.tracker.log_metrics(
                POPULATION_RUN,
                {"best_fitness": best.fitness[-1], "mean_fitness": mean},
                self.step,
            )
        self.evaluated_at = self.step

    def evolve(self) -> None:
        previous = [agent.member_id for agent in self.pop]
        self.pop.evolve(*self.evolution)
        self.evolved_at = self.step
        if self.tracker is not None:
            for member_id in previous:
                self.tracker.end_run(member_id)
        self._start_runs()
        for agent in self.pop:
            self._say(f"  {agent.member_id} <- {agent.parent_id}: {agent.mutation}")

    def _reached(self, target: float | None) -> bool:
        if target is None or self.evaluated_at != self.step:
            return False
        if max(agent.fitness[-1] for agent in self.pop) >= target:
            self._say(f"target fitness {target} reached at step {self.step}")
            return True
        return False

    # -- checkpoints -----------------------------------------------------------------------

    def save(self) -> None:
        """Checkpoint every member, then replace the state file; then drop what it no longer
        references. A crash at any point leaves the previous state and its checkpoints whole."""
        folder = self.out / "checkpoints"
        members = []
        for agent in self.pop:
            name = f"step{self.step:06d}-{agent.member_id}"
            agent.save_checkpoint(folder / name)
            members.append(
                {
                    "member_id": agent.member_id,
                    "checkpoint": f"checkpoints/{name}",
                    "is_elite": agent.is_elite,
                }
            )
        if self.rank == 0:
            state = {
                "version": STATE_VERSION,
                "algorithm": self.pop.manifest.algorithm.name,
                "base_model": self.pop.manifest.model.name,
                "step": self.step,
                "generation": self.pop.generation,
                "evaluated_at": self.evaluated_at,
                "evolved_at": self.evolved_at,
                "rng": rng_to_json(self.pop.rng),
                "members": members,
                "elite": self.pop.elite.member_id if self.pop.elite else None,
            }
            write_json_atomic(self.out / STATE_FILE, state)
            keep = {Path(m["checkpoint"]).name for m in members}
            for old in folder.iterdir():
                if old.name not in keep:
                    shutil.rmtree(old, ignore_errors=True)
        self.saved_at = self.step
        self._say(f"saved {len(members)} members at step {self.step} in {folder}")

    def restore(self) -> None:
        """Take up the population saved in ``out``, if any."""
        state = read_json(self.out / STATE_FILE)
        if state is None:
            return
        manifest = self.pop.manifest
        expected = {"algorithm": manifest.algorithm.name, "base_model": manifest.model.name}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ConfigError(
                    [
                        f"output_dir {self.out} holds a population with {key} "
                        f"{state.get(key)!r}, but this one has {value!r}; use another output_dir "
                        "or resume=False"
                    ]
                )
        for agent in list(self.pop):
            self.pop.remove(agent)
        agents = []
        for entry in state["members"]:
            member_id = plain_name(entry["member_id"], f"a member id in {self.out / STATE_FILE}")
            record = MemberRecord(member_id=member_id, generation=state["generation"])
            agent = self.pop.agent_class.of(self.pop, record)
            self.pop.agents.append(agent)
            try:
                what = f"a checkpoint named in {self.out / STATE_FILE}"
                agent.load_checkpoint(inside(self.out, entry["checkpoint"], "checkpoints", what))
            except PbtError as err:
                raise PbtError(f"cannot resume from {self.out}: {err}") from None
            agent.is_elite = bool(entry["is_elite"])
            agents.append(agent)
        self.pop.generation = state["generation"]
        self.pop.rng.setstate(rng_from_json(state["rng"]).getstate())
        self.pop.elite = next((a for a in agents if a.member_id == state["elite"]), None)
        self.step = state["step"]
        self.evaluated_at = state["evaluated_at"]
        self.evolved_at = state["evolved_at"]
        self.saved_at = self.step
        self._say(f"resumed {len(agents)} members at step {self.step} from {self.out}")

    # -- output ----------------------------------------------------------------------------

    def _start_runs(self) -> None:
        """Start (or reopen) the population's run and every member's, as
        :mod:`pbt.tracking.run_schema` says."""
        if self.tracker is None:
            return
        start_parent(
            self.tracker,
            POPULATION_RUN,
            name=self.out.name,
            manifest=self.pop.manifest,
            size=len(self.pop),
        )
        start_members(self.tracker, self.pop, parent=POPULATION_RUN)

    def _log(self, agent: Agent, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log_metrics(agent.member_id, metrics, step)

    def _say(self, line: str) -> None:
        if self.progress and self.rank == 0:
            elapsed = time.perf_counter() - self.started
            tqdm.write(f"[{elapsed:7.1f}s] {line}", file=sys.stdout)  # above a bar, if any
            sys.stdout.flush()

    def _bar(self, member_id: str, steps: int) -> tqdm:
        """A member's bar while it trains ``steps`` steps: on a terminal only, where it is
        cleared when the member's line is printed; elsewhere a no-op."""
        shown = self.progress and self.rank == 0 and sys.stdout.isatty()
        return tqdm(
            total=steps,
            desc=f"  {member_id}",
            file=sys.stdout,
            leave=False,
            disable=not shown,
            mininterval=0,  # a redraw a step costs nothing beside the step
        )

    def close(self) -> None:
        if self.tracker is not None:
            for agent in self.pop:
                self.tracker.end_run(agent.member_id)
            self.tracker.end_run(POPULATION_RUN)
            self.tracker.close()


def _tracker(out: Path, tracking: bool | str) -> Tracker:
    uri = default_uri(out) if tracking is True else str(tracking)
    return Tracker(uri, experiment=population_experiment(out), journal_dir=out / "tracking")


def _bar_words(metrics: dict[str, float]) -> str:
    """``reward 0.410 312 tok/s``: what a bar shows of a step, of what the step measured."""
    words = []
    if "reward_mean" in metrics:
        words.append(f"reward {metrics['reward_mean']:.3f}")
    if "tokens_per_s" in metrics:
        words.append(f"{metrics['tokens_per_s']:.0f} tok/s")
    return " ".join(words)


def _next_multiple(value: int, interval: int) -> int:
    return (value // interval + 1) * interval
