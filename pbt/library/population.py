"""Library mode: a population you drive from your own loop, on one shared base model.

    pop = create_population(algo="GRPO", INIT_HP={"LR": 1e-4}, population_size=4)
    for agent in pop:
        prompts = agent.sample_prompts()
        batch = agent.get_action(prompts)
        agent.learn((batch, agent.reward(prompts, batch)))
        agent.test()
    pop = pop.tournament.select(pop)
    pop = pop.mutations.mutation(pop)

The same selection, mutation and checkpoint code as campaigns. Every member of a population
lives on ONE frozen base model in this process
(:class:`pbt.algorithms.runtime.shared_base.SharedBase`):
a member is its adapter, optimizer state, schedule, RNG streams and step, so a population of 8
costs about one model, and cloning a member copies an adapter. Nothing is loaded until an
agent is first used, so building a population costs nothing and imports no torch. Generation
0's records are :func:`pbt.evolution.breeding.initial_records`, the ones a campaign's controller
stores for its first generation (it builds no population and never loads a model).

Under torchrun every rank builds the same population and makes the same calls in the same
order; each agent call is then a collective of the member's ranks.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pbt.config import Manifest
from pbt.config.errors import ConfigError, PbtError
from pbt.config.ranges import BatchRule, batch_rule
from pbt.config.read.canonical import canonical_sections, manifest_from_canonical
from pbt.config.sections.fsdp import FSDPConfig
from pbt.evolution.breeding import breed, build_mutations, build_selection, child_record
from pbt.library.evolve import (
    PopulationMutations,
    PopulationSelection,
    population_mutations,
    selection_rule,
)
from pbt.protocol.records import MemberRecord, member_seed

if TYPE_CHECKING:
    from pbt.algorithms.data.tasks import Example
    from pbt.algorithms.rollout.hf import RolloutBatch
    from pbt.algorithms.runtime.member import Member, StepCallback
    from pbt.algorithms.runtime.shared_base import SharedBase
    from pbt.evolution.selection import Selected


class Agent:
    """One member of a library-mode population.

    A handle: the member's weights and optimizer state live in its population's shared base,
    made on first use. ``fitness`` is the list of its evaluations (its lineage's, parents'
    included), as in AgileRL.
    """

    def __init__(self, population: Population, record: MemberRecord) -> None:
        self.population = population
        self.member_id = record.member_id
        self.generation = record.generation
        self.parent_id = record.parent_id
        self.mutation = record.mutation
        self.fitness: list[float] = list(record.fitness_history)
        self.is_elite = False
        self._hyperparameters = dict(record.hyperparameters)
        self._steps = record.steps
        self._removed = False

    @classmethod
    def of(cls, population: Population, record: MemberRecord) -> Agent:
        """An agent of this class for ``record`` in ``population``, whatever its constructor
        takes (``GRPO(...)`` takes AgileRL's arguments and builds a population of its own)."""
        agent = cls.__new__(cls)
        Agent.__init__(agent, population, record)
        return agent

    def __repr__(self) -> str:
        last = f"{self.fitness[-1]:.4f}" if self.fitness else "none"
        return f"{type(self).__name__}({self.member_id}, steps={self.steps}, fitness={last})"

    # -- what the member is ----------------------------------------------------------------

    @property
    def materialised(self) -> bool:
        engine = self.population._engine
        return engine is not None and self.member_id in engine.members

    @property
    def hyperparameters(self) -> dict[str, float]:
        """The current values of the mutable hyperparameters."""
        if self.materialised:
            return self._member().learner.hyperparameters()
        return dict(self._hyperparameters)

    def set_hyperparameters(self, values: dict[str, float]) -> None:
        """Change hyperparameters in place; a new lr lands in the optimizer, Adam's moments kept."""
        self._hyperparameters |= dict(values)
        if self.materialised:
            self._member().learner.apply_hyperparameters(values)

    @property
    def steps(self) -> int:
        """Training steps taken by this member's lineage."""
        return self._member().learner.step if self.materialised else self._steps

    @property
    def collapsed(self) -> bool:
        """Whether its last ``algorithm.collapse_patience`` training steps all had no signal:
        selection replaces it."""
        return self.materialised and self._member().collapsed

    @property
    def stopped(self) -> bool:
        """Whether its training ended early because it collapsed (a clone of it starts again)."""
        return self.materialised and self._member().stopped

    def record(self) -> MemberRecord:
        """This member as the controller's plain record."""
        return MemberRecord(
            member_id=self.member_id,
            generation=self.generation,
            parent_id=self.parent_id,
            hyperparameters=self.hyperparameters,
            mutation=self.mutation,
            fitness_history=list(self.fitness),
            steps=self.steps,
            collapsed=self.collapsed,
        )

    # -- AgileRL-style calls ---------------------------------------------------------------

    def sample_prompts(self) -> list[Example]:
        """This rank's share of ``prompts_per_step`` training prompts, drawn by this member."""
        member = self._activate()
        return member.learner.sample_prompts(member.task.train)

    def get_action(self, prompts: Sequence[Example | str], training: bool = True) -> RolloutBatch:
        """Completions for ``prompts``: ``group_size`` samples each when ``training``, else one
        greedy completion each. ``batch.texts`` holds the decoded text, rows grouped by prompt."""
        member = self._activate()
        questions = [p if isinstance(p, str) else p.chat for p in prompts]
        return member.learner.complete(questions, training)

    def reward(self, prompts: Sequence[Example], batch: RolloutBatch):
        """The task's rewards ``[N]`` for ``batch``, whose rows are grouped by ``prompts``."""
        member = self._activate()
        return member.learner.score(list(prompts), batch, member.task.reward)

    def learn(self, experiences, rewards=None) -> dict[str, float]:
        """One update. GRPO and REINFORCE: from ``(batch, rewards)`` (or ``learn(batch,
        rewards)``); SFT and DPO: from a list of examples (``agent.sample_prompts()``).

        Returns the step's metrics: ``loss``, and for RL ``kl``, ``reward_mean``, ...
        """
        learner = self._activate().learner
        if rewards is None and isinstance(experiences, list):
            return learner.learn(experiences)
        batch, rewards = experiences if rewards is None else (experiences, rewards)
        return learner.learn(batch, rewards)

    def describe(self, metrics: dict[str, float]) -> str:
        """A short progress line for a step's metrics, in this algorithm's terms: those of
        :meth:`train_step` or of :meth:`learn` (which times no rollout, so its throughput
        reads ``nan tok/s``)."""
        return self._member().learner.describe(_Unmeasured(metrics))

    def train_step(self) -> dict[str, float]:
        """Sample prompts, roll out, score and learn: one training step; returns its metrics."""
        return self._activate().train_step()

    def train(
        self,
        steps: int,
        on_step: StepCallback | None = None,
        say: Callable[[str], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train ``steps`` steps (the loop campaign members train in), or fewer when the member
        collapses (:attr:`collapsed`); returns every step's metrics, each with its ``"step"``.
        ``on_step(step, metrics)`` follows each step; ``say`` explains, once, a step that
        learned nothing (identical rewards in every group), and announces a collapse."""
        return self._activate().train(steps, on_step, say)

    def test(self, examples: Sequence[Example] | None = None, temperature: float | None = None):
        """Mean reward on the task's held-out prompts (or ``examples``); appended to ``fitness``.

        Greedy unless ``temperature`` (default ``training.eval_temperature``) is above 0.
        """
        member = self._activate()
        manifest = self.population.manifest
        temp = manifest.training.eval_temperature if temperature is None else temperature
        fitness = member.learner.evaluate(
            list(examples) if examples is not None else member.task.eval,
            member.task.reward,
            temp,
        )
        self.fitness.append(fitness)
        return fitness

    def clone(self, member_id: str | None = None) -> Agent:
        """A copy of this member (adapter, optimizer, schedule, step, fitness, hyperparameters)
        under a new id, in the same population but not in its list; see
        :meth:`Population.next_generation` for how selection places clones."""
        child_id = member_id or self.population._fresh_id()
        return self.population._clone(self, child_record(self.record(), child_id, self.generation))

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> str | None:
        """Write this member as a standard checkpoint (loads in campaigns, ``pbt inspect`` and
        ``PeftModel.from_pretrained``); returns its digest on rank 0. A collective."""
        member = self._activate()
        member.fitness = list(self.fitness)
        member.lineage = {
            "member": self.member_id,
            "parent": self.parent_id,
            "generation": self.generation,
            "mutation": self.mutation,
        }
        return member.save(path)

    def load_checkpoint(self, path: str | Path) -> None:
        """Become the member saved at ``path`` (library or campaign checkpoint, any world size):
        adapter, optimizer, schedule, RNG, step, hyperparameters and fitness.

        Raises:
            CheckpointError: the checkpoint is damaged or was trained on another model,
                algorithm or LoRA shape.
        """
        member = self._activate()
        attrs = member.load(path)
        self.fitness = list(member.fitness)
        self._hyperparameters = member.learner.hyperparameters()
        lineage = attrs.get("lineage", {})
        self.parent_id = lineage.get("parent", self.parent_id)
        self.mutation = lineage.get("mutation", self.mutation)

    # -- internals -------------------------------------------------------------------------

    def _activate(self) -> Member:
        if self._removed:
            raise PbtError(
                f"agent {self.member_id} was removed from its population (selection keeps "
                "clones, not the old agents); use the agents of the population selection returned"
            )
        return self.population._materialise(self)

    def _member(self) -> Member:
        return self.population._engine.member(self.member_id)


class Population(Sequence[Agent]):
    """The agents of one generation, their shared base, and the generator evolution draws from.

    Made by :func:`create_population` (or ``GRPO.population(...)``). Indexing and iterating
    give the agents, each of ``agent_class`` (``GRPO.population`` makes ``GRPO`` agents);
    :attr:`tournament` and :attr:`mutations` are the selection and mutation the configuration
    describes, and :meth:`evolve` applies both.
    """

    def __init__(
        self,
        manifest: Manifest,
        records: list[MemberRecord],
        rng: random.Random,
        agent_class: type[Agent] = Agent,
    ):
        self.manifest = manifest
        self.rng = rng
        self.agent_class = agent_class
        self.generation = max((r.generation for r in records), default=0)
        self.agents = [agent_class.of(self, r) for r in records]
        self.elite: Agent | None = None
        self._engine: SharedBase | None = None
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.agents)

    def use_task(self, task: dict[str, Any]) -> None:
        """Train on ``task`` (a ``task`` section) instead of the configuration's, validated
        with the rest of it; only before any member is loaded (the base model holds the task).

        Raises:
            ConfigError: the section breaks a rule, or members are loaded already.
        """
        if self._engine is not None:
            raise ConfigError(
                ["the population's members are loaded already; give it the task before training"]
            )
        sections = {**canonical_sections(self.manifest), "task": task}
        self.manifest = manifest_from_canonical(sections, self.manifest.base_dir, "task")

    def __getitem__(self, index):
        return self.agents[index]

    def __iter__(self) -> Iterator[Agent]:
        return iter(list(self.agents))

    def __repr__(self) -> str:
        return f"Population(generation {self.generation}, {self.agents})"

    def records(self) -> list[MemberRecord]:
        """The agents as controller records (what a campaign stores)."""
        return [agent.record() for agent in self.agents]

    @property
    def tournament(self) -> PopulationSelection:
        """The selection the manifest describes, over this population's size:
        ``pop = pop.tournament.select(pop)``."""
        manifest = dataclasses.replace(
            self.manifest, population=dataclasses.replace(self.manifest.population, size=len(self))
        )
        return PopulationSelection(build_selection(manifest))

    @property
    def mutations(self) -> PopulationMutations:
        """The mutation the manifest describes: ``pop = pop.mutations.mutation(pop)``."""
        return PopulationMutations(build_mutations(self.manifest, self._ranks()))

    @property
    def batch_rule(self) -> BatchRule:
        """The batch rules its members' group size and prompts per step keep (what a
        :class:`Mutations` built without a manifest checks a mutation against)."""
        return batch_rule(self.manifest, self._ranks())

    def _ranks(self) -> int | None:
        """Ranks each member's step splits over: this process group's once the base is
        loaded; before, None (the manifest's launch ranks)."""
        return self._engine.world.world_size if self._engine is not None else None

    def evolve(self, tournament=None, mutations=None) -> Population:
        """Selection, then mutation; returns this population.

        Args:
            tournament: A selection: :attr:`tournament`'s kind, a rule of
                :mod:`pbt.evolution.selection`, or :mod:`pbt.hpo`'s ``TournamentSelection``;
                default :attr:`tournament`, as configured.
            mutations: A :class:`~pbt.evolution.mutation.Mutations` rule, or anything with
                ``mutation(population)`` (:attr:`mutations`' kind, :mod:`pbt.hpo`'s);
                default :attr:`mutations`.
        """
        rule = selection_rule(tournament or self.tournament)
        self.next_generation(rule.select(self.records(), self.rng))
        return population_mutations(mutations or self.mutations).mutation(self)

    def next_generation(self, selected: list[Selected]) -> Population:
        """Replace the agents by clones of the selected parents (elite first); free the rest.

        What :meth:`PopulationSelection.select` calls. Clones are
        named like campaign members (``g001-m00``) and start with mutation ``none``.
        """
        by_id = {agent.member_id: agent for agent in self.agents}
        generation = self.generation + 1
        children = []
        for choice, record in zip(selected, breed(selected, generation), strict=True):
            child = self._clone(by_id[choice.parent.member_id], record)
            child.is_elite = choice.is_elite
            children.append(child)
        for agent in list(self.agents):
            self.remove(agent)
        self.agents = children
        self.generation = generation
        self.elite = children[0] if selected and selected[0].is_elite else None
        return self

    def get_actions(
        self, prompts: dict[Agent, Sequence[Example | str]], training: bool = True
    ) -> dict[Agent, RolloutBatch]:
        """Completions for several agents at once, each from its own adapter: ``group_size``
        samples per prompt when ``training``, else one greedy completion. With a vLLM rollout
        every agent's prompts go to the engine in ONE batch (a LoRA request per prompt); with
        ``generate`` the agents take turns."""
        for agent in prompts:
            self._materialise(agent)
        questions = {
            agent.member_id: [p if isinstance(p, str) else p.chat for p in asked]
            for agent, asked in prompts.items()
        }
        batches = self._shared().complete_all(questions, training)
        return {agent: batches[agent.member_id] for agent in prompts}

    def remove(self, agent: Agent) -> None:
        """Take ``agent`` out of the population and free its adapter and optimizer state."""
        if agent in self.agents:
            self.agents.remove(agent)
        if agent.materialised:
            self._engine.remove(agent.member_id)
        agent._removed = True

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the base model and each member (see ``SharedBase``)."""
        return self._shared().memory_bytes()

    # -- the shared base -------------------------------------------------------------------

    def _shared(self) -> SharedBase:
        if self._engine is None:
            from pbt.algorithms.runtime.shared_base import SharedBase
            from pbt.distributed import pick_device, world_info

            _check_launch(self.manifest)
            device = pick_device(self.manifest.training.device, world_info().local_rank)
            self._engine = SharedBase(self.manifest, device)
        return self._engine

    def _materialise(self, agent: Agent) -> Member:
        engine = self._shared()
        if agent.member_id not in engine.members:
            seed = member_seed(self.manifest.training.seed, agent.member_id)
            member = engine.add(agent.member_id, seed)
            member.learner.apply_hyperparameters(agent._hyperparameters)
            member.learner.step = agent._steps
        return engine.activate(agent.member_id)

    def _clone(self, parent: Agent, record: MemberRecord) -> Agent:
        """The agent of ``record``, a child of ``parent`` (:func:`child_record`), holding a
        copy of the parent's state when the parent has any."""
        child = self.agent_class.of(self, record)
        if parent.materialised:
            seed = member_seed(self.manifest.training.seed, record.member_id)
            self._engine.clone(parent.member_id, record.member_id, seed)
        return child

    def _fresh_id(self) -> str:
        taken = {a.member_id for a in self.agents}
        if self._engine is not None:
            taken |= set(self._engine.members)
        while True:
            self._next_id += 1
            candidate = f"g{self.generation:03d}-c{self._next_id:02d}"
            if candidate not in taken:
                return candidate


def _check_launch(manifest: Manifest) -> None:
    """FSDP2 shards over a process group, which only a launcher makes: refuse, in one line,
    to load a sharded population in a plain ``python script.py`` (AgileRL: construct it only
    under torchrun)."""
    import torch.distributed as dist

    sharded = FSDPConfig.from_value(manifest.distributed.fsdp) is not None
    if sharded and "MASTER_ADDR" not in os.environ and not dist.is_initialized():
        raise PbtError(
            "fsdp_config (distributed.fsdp) shards the model over a process group, and this "
            "process has none: launch the script with torchrun (torchrun --nproc_per_node=N "
            "script.py; N=1 works), or drop fsdp_config to train data parallel"
        )


class _Unmeasured(dict):
    """Step metrics in which a figure the step did not measure (the throughput of a
    :meth:`Agent.learn`, which sees no rollout) reads as NaN rather than failing."""

    def __missing__(self, key: str) -> float:
        return float("nan")
