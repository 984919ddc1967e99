"""Selection and mutation applied to a library population in place.

The rules themselves (:mod:`pbt.evolution.selection`, :mod:`pbt.evolution.mutation`) read and
return plain records, as a campaign uses them. A population applies them to its agents::

    pop = pop.tournament.select(pop)   # clones of the chosen parents, elite first
    pop = pop.mutations.mutation(pop)  # each agent keeps or moves one hyperparameter

:attr:`Population.tournament` and :attr:`Population.mutations` are these two, built from the
population's manifest. AgileRL's spellings (``elite, pop = tournament.select(pop)``) are
:mod:`pbt.hpo`'s.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Protocol

from pbt.config.ranges import BatchRule
from pbt.evolution.mutation import Mutations
from pbt.evolution.selection import Selected, TournamentSelection, TruncationSelection
from pbt.protocol.records import MemberRecord


class Population(Protocol):
    """What evolution needs of a population (:class:`pbt.library.population.Population`)."""

    rng: random.Random
    batch_rule: BatchRule

    def records(self) -> list[MemberRecord]: ...
    def next_generation(self, selected: list[Selected]) -> Any: ...
    def __iter__(self) -> Iterator[Any]: ...


SelectionRule = TournamentSelection | TruncationSelection
"""The selection rules a population can be evolved with (``pbt.hpo``'s is a tournament)."""


class PopulationSelection:
    """A selection rule applied to a population: the agents become clones of its parents.

    Args:
        rule: The rule that chooses the parents from the population's records.
    """

    def __init__(self, rule: SelectionRule) -> None:
        self.rule = rule

    @property
    def fitness_window(self) -> int:
        """How many of each member's latest evaluations the rule averages."""
        return self.rule.fitness_window

    def __repr__(self) -> str:
        return f"PopulationSelection({type(self.rule).__name__})"

    def select(self, population: Population, rng: random.Random | None = None) -> Population:
        """Replace the agents by clones of the parents the rule chooses (elite first); returns
        the population.

        Args:
            population: The evaluated population.
            rng: The generator to draw from; default the population's own.
        """
        chosen = self.rule.select(population.records(), rng or population.rng)
        return population.next_generation(chosen)


class PopulationMutations:
    """A mutation rule applied to every agent of a population, in place.

    Args:
        rule: The mutation rule; without batch rules of its own, each population's
            (:attr:`Population.batch_rule`) are kept.
    """

    def __init__(self, rule: Mutations) -> None:
        self.rule = rule

    def __repr__(self) -> str:
        return f"PopulationMutations({sorted(self.rule.ranges)})"

    def mutation(self, population: Population, rng: random.Random | None = None) -> Population:
        """Each agent keeps or changes one hyperparameter (the elite as ``mutate_elite``
        says), in place; returns the population.

        Args:
            population: The population, after selection.
            rng: The generator to draw from; default the population's own.
        """
        rng = rng or population.rng
        rule = self.rule.rule or population.batch_rule
        for agent in population:
            values, how = self.rule.mutate(agent.hyperparameters, rng, agent.is_elite, rule)
            agent.set_hyperparameters(values)
            agent.mutation = how
        return population


def selection_rule(tournament: PopulationSelection | SelectionRule) -> SelectionRule:
    """The rule behind ``tournament``, whichever of the two forms it is."""
    return tournament.rule if isinstance(tournament, PopulationSelection) else tournament


def population_mutations(mutations) -> PopulationMutations:
    """``mutations`` as applied to a population: a plain :class:`Mutations` rule is wrapped;
    anything else with ``mutation(population)`` (``pbt.hpo``'s) is used as it is."""
    return PopulationMutations(mutations) if isinstance(mutations, Mutations) else mutations
