"""Multi-frequency selection: sub-populations that evolve at different rates, and migrate.

Multiple-frequencies PBT (Doulazmi et al.; shipped by AgileRL as ``agilerl.hpo.multi_frequency``)
splits the population into ``subpopulations`` equal groups by slot (slots ``0 .. s-1`` are the
first, and so on). Every member still trains every generation; group ``i`` evolves only after
every ``frequencies[i]``-th generation (default ``1, 5, 10, ...``), so a slow group is not
greedy: a configuration that starts slowly survives there long enough to show its worth, and
the fast group still finds a schedule at the population's own granularity.

When a group evolves, its members are ranked by fitness and cut, best first, into four
brackets of ``brackets = [winners, survivors, open, losers]`` members (default: a quarter
winners, no survivors, a quarter open, the rest losers):

- each loser is replaced by a copy of a winner drawn uniformly, and the copy is explored (the
  campaign's mutation, as truncation selection's copies are);
- winners and survivors continue unchanged (explored too under ``mutation.perturb_survivors``;
  the members of a group that does not evolve are left alone either way);
- each open member, best first, is compared with the best not yet taken member of the *other*
  groups, ranked by fitness before anything evolved: when that outsider is fitter it migrates
  into the open slot, else the slot keeps its member and the same outsider is offered to the
  next open slot. The migration is asymmetric: an outsider from a group that evolves more often
  (a smaller frequency) brings its weights but takes the hyperparameters of the destination's
  best member, since fast groups' values are tuned to a short horizon; one from a slower group
  comes whole. A migrant is not explored.

The generation decides which groups evolve (group ``i`` after generation ``g`` when
``(g + 1) % frequencies[i] == 0``), and every random choice comes from the ``random.Random``
passed to :meth:`MultiFrequencySelection.select`, so a resumed campaign selects the same.
Controller code: no torch.
"""

from __future__ import annotations

import random

from pbt.config.errors import ConfigError
from pbt.config.sections.campaign import (
    multi_frequency_problems,
    resolved_brackets,
    resolved_frequencies,
)
from pbt.evolution.selection import Selected, _score
from pbt.protocol.records import MemberRecord


class MultiFrequencySelection:
    """Selects the next generation group by group, each group at its own frequency.

    Args:
        population_size: Members in the population; a multiple of ``subpopulations``.
        subpopulations: Number of groups (>= 2).
        frequencies: Generations between two evolutions of each group, strictly increasing;
            None gives ``1, 5, 10, ...``.
        brackets: ``[winners, survivors, open, losers]`` of each group, summing to its size;
            None gives a quarter winners, no survivors, a quarter open, the rest losers.
        fitness_window: How many of each member's latest evaluations are averaged.

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        population_size: int,
        subpopulations: int = 2,
        frequencies: list[int] | None = None,
        brackets: list[int] | None = None,
        fitness_window: int = 1,
    ) -> None:
        problems = multi_frequency_problems(population_size, subpopulations, frequencies, brackets)
        if problems:
            raise ConfigError(problems)
        self.population_size = population_size
        self.subpopulations = subpopulations
        self.group_size = population_size // subpopulations
        self.frequencies = resolved_frequencies(frequencies, subpopulations)
        self.brackets = resolved_brackets(brackets, self.group_size)
        self.fitness_window = fitness_window

    def group_of(self, slot: int) -> int:
        """The group of the member in ``slot``."""
        return slot // self.group_size

    def evolving(self, generation: int) -> list[int]:
        """The groups that evolve once ``generation`` has trained."""
        return [i for i, f in enumerate(self.frequencies) if (generation + 1) % f == 0]

    def select(self, population, rng: random.Random | None = None):
        """The parents of the next generation, in slot order.

        Args:
            population: The evaluated members of one generation, in slot order, or a
                library-mode ``Population``.
            rng: The seeded generator, the only source of randomness used.

        Returns:
            As :meth:`~pbt.evolution.selection.TournamentSelection.select`: a loser's slot is a
            copy to explore, a migrant's slot carries its values (``hyperparameters``), every
            other slot is a survivor.
        """
        next_generation = getattr(population, "next_generation", None)
        if next_generation is not None:
            return next_generation(self.select(population.records(), rng or population.rng))
        if rng is None:
            raise TypeError("select(records, rng): a list of records needs the campaign's rng")
        if len(population) != self.population_size:
            raise ConfigError(
                [
                    f"population.size ({self.population_size}) must equal the members to select "
                    f"from ({len(population)}) under multi-frequency selection; pass the whole "
                    "generation"
                ]
            )
        scores = [_score(member, self.fitness_window) for member in population]
        # a group that does not evolve now is left alone, even under perturb_survivors
        chosen = [
            Selected(
                parent=m,
                is_elite=False,
                survivor=True,
                hyperparameters=dict(m.hyperparameters),
                how="none (survivor)",
            )
            for m in population
        ]
        generation = max(m.generation for m in population)
        for group in self.evolving(generation):
            self._evolve(group, population, scores, chosen, rng)
        return chosen

    def _ranked(self, slots: list[int], scores: list[float]) -> list[int]:
        return sorted(slots, key=lambda i: (-scores[i], i))

    def _evolve(
        self,
        group: int,
        population: list[MemberRecord],
        scores: list[float],
        chosen: list[Selected],
        rng: random.Random,
    ) -> None:
        """Fill ``chosen``'s slots of ``group``: losers by winners' copies, open slots by
        migrants (from the snapshot ``population``, whatever other groups do)."""
        own = range(group * self.group_size, (group + 1) * self.group_size)
        for slot in own:  # kept members of an evolving group: explored under perturb_survivors
            chosen[slot] = Selected(parent=population[slot], is_elite=False, survivor=True)
        ranked = self._ranked(list(own), scores)
        n_win, n_keep, n_open, _ = self.brackets
        winners = ranked[:n_win]
        open_slots = ranked[n_win + n_keep : n_win + n_keep + n_open]
        for loser in ranked[n_win + n_keep + n_open :]:
            chosen[loser] = Selected(parent=population[rng.choice(winners)], is_elite=False)
        others = self._ranked([i for i in range(len(population)) if i not in own], scores)
        best = population[winners[0]]
        taken = 0
        for slot in open_slots:
            if taken >= len(others):
                break
            outsider = others[taken]
            if scores[slot] >= scores[outsider]:
                continue
            taken += 1
            source = population[outsider]
            if self.frequencies[self.group_of(outsider)] < self.frequencies[group]:
                values = dict(best.hyperparameters)
                how = f"migrated from {source.member_id} (weights; values of {best.member_id})"
            else:
                values = dict(source.hyperparameters)
                how = f"none (migrated whole from {source.member_id})"
            chosen[slot] = Selected(parent=source, is_elite=False, hyperparameters=values, how=how)
