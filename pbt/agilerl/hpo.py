"""Selection and mutation as AgileRL spells them (``agilerl.hpo.tournament``,
``agilerl.hpo.mutation``, ``agilerl.algorithms.core.registry``), over this package's own::

    from pbt.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection

    tournament = TournamentSelection(tournament_size=2, elitism=True, population_size=4)
    mutations = Mutations(no_mutation=0.4, architecture=0, new_layer_prob=0, parameters=0,
                          activation=0, rl_hp=0.6, mutation_sd=0.1, rand_seed=42)
    elite, pop = tournament.select(pop)
    pop = mutations.mutation(pop)

The selection and mutation themselves are :mod:`pbt.evolution.selection` and
:mod:`pbt.evolution.mutation`, the campaign's. Where AgileRL differs from them:

- ``select`` on a library population returns ``(elite, population)``, as AgileRL up to 2.8
  does (AgileRL 2.9 adds a third value, the indices to mutate: write ``elite, pop =``).
- ``eval_loop`` (AgileRL's older keyword) is ``fitness_window``: selection ranks each member
  by the mean of its last ``eval_loop`` evaluations.
- Architecture, parameter and activation mutations do not exist for an LLM's adapter: a
  weight above 0 for any of them is refused (ignoring it would change how often the others
  happen); ``new_layer_prob``, ``mutation_sd`` and ``activation_selection`` only shape those
  mutations, so they change nothing, as in AgileRL when those weights are 0.
- ``mutate_elite`` defaults to True, as in AgileRL; campaigns (``mutation.mutate_elite``)
  default to False.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from typing import Any

from pbt.config.errors import ConfigError
from pbt.config.ranges import (
    HPRange,
    HyperparameterConfig,
    RLParameter,
    hp_ranges,
    probability_problems,
)
from pbt.evolution import mutation as campaign_mutation
from pbt.evolution import selection as campaign_selection
from pbt.library.population import Agent, Population

__all__ = ["HyperparameterConfig", "Mutations", "RLParameter", "TournamentSelection"]

NO_ADAPTER_MUTATION = {
    "architecture": "an LLM adapter's architecture is fixed by the lora section",
    "parameters": "adapter weights change by training only",
    "activation": "the base model's activations are fixed",
}
"""AgileRL's mutation kinds that an LLM adapter cannot undergo, and why."""


class TournamentSelection(campaign_selection.TournamentSelection):
    """Tournament selection with AgileRL's constructor and return value.

    Args:
        tournament_size: Members drawn per tournament.
        elitism: Whether the best member is carried over as the first, elite, slot.
        population_size: How many members the next generation has.
        eval_loop: How many of each member's latest evaluations are averaged (AgileRL's
            older spelling of ``fitness_window``).
        fitness_window: The same, in this package's spelling.

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        tournament_size: int,
        elitism: bool,
        population_size: int,
        eval_loop: int | None = None,
        fitness_window: int | None = None,
    ) -> None:
        if None not in (eval_loop, fitness_window) and eval_loop != fitness_window:
            raise ConfigError(
                [
                    f"eval_loop ({eval_loop}) and fitness_window ({fitness_window}) name the "
                    "same setting with different values; pass one of them"
                ]
            )
        window = next((v for v in (fitness_window, eval_loop) if v is not None), 1)
        super().__init__(tournament_size, elitism, population_size, window)

    def select(self, population, rng: random.Random | None = None):
        """AgileRL's ``elite, pop = tournament.select(pop)`` on a library population.

        Args:
            population: A library ``Population``, or the controller's records (then with
                ``rng``, returning the parents as :class:`TournamentSelection` does).
            rng: The generator to draw from; default the population's own.

        Returns:
            ``(elite, population)``: the population now holds the next generation (clones of
            the winners, elite first), and ``elite`` is its elite agent, or without elitism
            the child of the fittest parent.
        """
        if not isinstance(population, Population):
            return super().select(population, rng)
        best = self._best_id(population)
        population.next_generation(super().select(population.records(), rng or population.rng))
        elite = population.elite or next(a for a in population if a.parent_id == best)
        return elite, population

    def _best_id(self, population: Population) -> str:
        records = population.records()
        scores = [campaign_selection._score(r, self.fitness_window) for r in records]
        return records[campaign_selection._best_index(scores)].member_id


class Mutations:
    """Mutation with AgileRL's constructor and ``pop = mutations.mutation(pop)``.

    Each agent keeps its hyperparameters or has one of them moved (grown, shrunk or
    resampled, clipped to its range), with odds ``no_mutation : rl_hp``; the ranges are the
    population's (its ``hp_config`` / ``mutation.ranges``) unless ``ranges`` is given.

    Args:
        no_mutation: Relative weight of leaving an agent unchanged.
        architecture: AgileRL's architecture mutation weight; must be 0 here.
        new_layer_prob: Shapes architecture mutations only; no effect.
        parameters: AgileRL's weight-noise mutation weight; must be 0 here.
        activation: AgileRL's activation mutation weight; must be 0 here.
        rl_hp: Relative weight of moving one hyperparameter.
        mutation_sd: The strength of weight-noise mutations, which do not happen; no effect.
        activation_selection: The activations to choose from; no effect.
        mutate_elite: Whether the elite may be mutated (AgileRL's default, True).
        rand_seed: Seeds this object's own generator; without it, the population's is used
            (which ``train_population`` saves and restores for an exact resume).
        device: Where AgileRL puts mutated networks; no effect.
        accelerator: AgileRL's Accelerate object; members run under torchrun instead.
        rl_hp_selection: Only these hyperparameters may move (default: every ranged one).
        ranges: Ranges to use instead of the population's.
        resample_probability: Chance a move draws a fresh value from the range.

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        no_mutation: float = 0.4,
        architecture: float = 0,
        new_layer_prob: float = 0,
        parameters: float = 0,
        activation: float = 0,
        rl_hp: float = 0.6,
        mutation_sd: float = 0.1,
        activation_selection: Sequence[str] | None = None,
        mutate_elite: bool = True,
        rand_seed: int | None = None,
        device: str = "cpu",
        accelerator: Any = None,
        *,
        rl_hp_selection: Sequence[str] | None = None,
        ranges: dict[str, Any] | None = None,
        resample_probability: float = 0.0,
    ) -> None:
        weights = {"architecture": architecture, "parameters": parameters, "activation": activation}
        problems = [
            f"Mutations({kind}={weights[kind]}) must be 0: {why}; set {kind}=0 and put its "
            "weight on rl_hp or no_mutation"
            for kind, why in NO_ADAPTER_MUTATION.items()
            if weights[kind] != 0
        ]
        problems += probability_problems(no_mutation, rl_hp, resample_probability)
        if rand_seed is not None and (not isinstance(rand_seed, int) or rand_seed < 0):
            problems.append(f"Mutations(rand_seed={rand_seed!r}) must be an integer >= 0 or None")
        if problems:
            raise ConfigError(problems)
        if new_layer_prob:
            warnings.warn(
                f"Mutations(new_layer_prob={new_layer_prob}) has no effect: there are no "
                "architecture mutations",
                stacklevel=2,
            )
        if accelerator is not None:
            warnings.warn(
                "Mutations(accelerator=...) has no effect: members run under torchrun",
                stacklevel=2,
            )
        self.no_mutation = no_mutation
        self.rl_hp = rl_hp
        self.mutate_elite = mutate_elite
        self.resample_probability = resample_probability
        self.rl_hp_selection = None if rl_hp_selection is None else list(rl_hp_selection)
        self.ranges = ranges
        self.rng = None if rand_seed is None else random.Random(rand_seed)

    def mutation(
        self,
        population: Population,
        pre_training_mut: bool = False,
        indices: Sequence[int] | None = None,
    ) -> Population:
        """Mutate the agents in place (those at ``indices`` when given); returns the population.

        ``pre_training_mut`` is accepted for AgileRL's calls: it only matters to architecture
        mutations there.
        """
        inner = self._campaign_mutations(population)
        rng = self.rng or population.rng
        chosen = range(len(population)) if indices is None else indices
        for slot in chosen:
            agent: Agent = population[slot]
            values, how = inner.mutate(agent.hyperparameters, rng, is_elite=agent.is_elite)
            agent.set_hyperparameters(values)
            agent.mutation = how
        return population

    def _campaign_mutations(self, population: Population) -> campaign_mutation.Mutations:
        ranges = self._ranges(population)
        return campaign_mutation.Mutations(
            ranges, self.no_mutation, self.rl_hp, self.mutate_elite, self.resample_probability
        )

    def _ranges(self, population: Population) -> dict[str, HPRange]:
        if self.ranges is None:
            ranges = hp_ranges(population.manifest)
        else:
            ranges = {
                name: value if isinstance(value, HPRange) else HPRange(**_spec(name, value))
                for name, value in self.ranges.items()
            }
        if self.rl_hp_selection is None:
            return ranges
        unknown = [name for name in self.rl_hp_selection if name not in ranges]
        if unknown:
            raise ConfigError(
                [
                    f"Mutations(rl_hp_selection={self.rl_hp_selection}) names {unknown}, which "
                    f"have no range; ranged: {sorted(ranges)} (add them to hp_config)"
                ]
            )
        return {name: ranges[name] for name in self.rl_hp_selection}


def _spec(name: str, value: Any) -> dict[str, Any]:
    return value.spec(f"ranges.{name}") if isinstance(value, RLParameter) else dict(value)
