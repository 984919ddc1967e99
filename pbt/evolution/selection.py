"""Selection of the next generation's parents: tournament (AgileRL's semantics) or truncation.

With elitism, slot 0 is the single best member by mean fitness over its last
``fitness_window`` evaluations (ties go to the lowest index); every other slot is filled by a
tournament: ``tournament_size`` members drawn uniformly without replacement, the fittest wins
(ties go to the first drawn). A member that has never been evaluated has fitness ``-inf`` and
loses to any member that has; so does a collapsed one (its task ended for lack of signal,
:mod:`pbt.protocol.collapse`), whatever fitness it measured: it is never the elite nor a
tournament's winner while any other member can be.

Truncation selection is the exploit step of the original PBT (Jaderberg et al., 2017): the
members in the bottom ``fraction`` by fitness are replaced by copies of members drawn uniformly
from the top ``fraction``, and everyone else continues its own lineage unchanged (a survivor,
which mutation leaves alone). With ``min_gap`` a bottom member is replaced only when the drawn
parent is more than ``min_gap`` fitter (an exploit on a real difference, not on evaluation noise),
and with ``ready_generations`` r nobody is replaced before every lineage has trained r
generations (a burn-in against PBT's short-horizon bias: a configuration that starts slowly is
not cut before it shows its worth).

Every random choice goes through the ``random.Random`` passed to :meth:`select`, so a campaign
seeded once makes the same choices on every run. Controller code: no torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pbt.config.errors import ConfigError
from pbt.config.sections.campaign import selection_problems, truncation_problems
from pbt.protocol.records import MemberRecord


@dataclass(frozen=True, slots=True)
class Selected:
    """One parent chosen for the next generation."""

    parent: MemberRecord
    """The member whose checkpoint and hyperparameters the child starts from."""
    is_elite: bool
    """True for the elite slot, which mutation leaves alone unless told otherwise."""
    survivor: bool = False
    """Truncation selection: the member continues its own lineage, unmutated."""
    hyperparameters: dict[str, float] | None = None
    """Set by a selection that decides the child's values itself (a migrant of multi-frequency
    selection): the child takes these, unmutated."""
    how: str | None = None
    """The child's description when ``hyperparameters`` is set."""


class TournamentSelection:
    """Chooses ``population_size`` parents by tournament, optionally keeping the best as elite.

    Args:
        tournament_size: Members drawn per tournament; 1 is uniform random choice, and
            ``population_size`` always picks the best.
        elitism: Whether the best member is carried over as the first, elite, slot.
        population_size: How many parents :meth:`select` returns.
        fitness_window: How many of each member's latest evaluations are averaged.

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        tournament_size: int,
        elitism: bool,
        population_size: int,
        fitness_window: int = 1,
    ) -> None:
        problems = selection_problems(tournament_size, elitism, population_size, fitness_window)
        if problems:
            raise ConfigError(problems)
        self.tournament_size = tournament_size
        self.elitism = elitism
        self.population_size = population_size
        self.fitness_window = fitness_window

    def select(self, population: list[MemberRecord], rng: random.Random) -> list[Selected]:
        """Choose the parents of the next generation.

        Args:
            population: The evaluated members of the current generation, in slot order.
            rng: The seeded generator, the only source of randomness used.

        Returns:
            Exactly ``population_size`` :class:`Selected` entries, the elite first with
            elitism. (A library population applies them to its agents:
            :mod:`pbt.library.evolve`.)

        Raises:
            ConfigError: When the population is smaller than one tournament.
        """
        self._check_population(population)
        scores = [_score(member, self.fitness_window) for member in population]
        chosen: list[Selected] = []
        if self.elitism:
            chosen.append(Selected(parent=population[_best_index(scores)], is_elite=True))
        while len(chosen) < self.population_size:
            winner = self._tournament(scores, rng)
            chosen.append(Selected(parent=population[winner], is_elite=False))
        return chosen

    def _tournament(self, scores: list[float], rng: random.Random) -> int:
        """Index of the fittest of ``tournament_size`` members drawn without replacement."""
        drawn = rng.sample(range(len(scores)), self.tournament_size)
        return _best_index(scores, drawn)

    def _check_population(self, population: list[MemberRecord]) -> None:
        if len(population) < self.tournament_size:
            raise ConfigError(
                [
                    f"population.tournament_size ({self.tournament_size}) must be <= the number "
                    f"of members to select from ({len(population)}); lower tournament_size or "
                    "pass the whole generation"
                ]
            )


class TruncationSelection:
    """Replaces the bottom ``fraction`` of the population by copies of the top ``fraction``.

    Args:
        fraction: Share of the population in the top and in the bottom group, in (0, 0.5];
            each group has ``max(1, round(fraction * population_size))`` members.
        population_size: How many parents :meth:`select` returns.
        fitness_window: How many of each member's latest evaluations are averaged.
        min_gap: A bottom member is replaced only when its drawn parent's fitness exceeds its
            own by more than this (0: always).
        ready_generations: No member is replaced while the population has trained fewer
            generations than this (0: from the first selection on).

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        fraction: float,
        population_size: int,
        fitness_window: int = 1,
        min_gap: float = 0.0,
        ready_generations: int = 0,
    ) -> None:
        problems = truncation_problems(fraction, min_gap, ready_generations)
        problems += selection_problems(1, False, population_size, fitness_window)
        if problems:
            raise ConfigError(problems)
        self.fraction = fraction
        self.population_size = population_size
        self.fitness_window = fitness_window
        self.min_gap = min_gap
        self.ready_generations = ready_generations

    def select(self, population: list[MemberRecord], rng: random.Random) -> list[Selected]:
        """The parents of the next generation, in slot order: slot ``i`` is member ``i`` itself
        (a survivor) or, for a bottom member, a top member drawn at random.

        Args:
            population: The evaluated members of the current generation, in slot order.
            rng: The seeded generator, the only source of randomness used.

        Returns:
            One :class:`Selected` per member.
        """
        scores = [_score(member, self.fitness_window) for member in population]
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        cut = min(len(order) // 2, max(1, round(self.fraction * len(order))))
        top, bottom = order[:cut], set(order[len(order) - cut :]) if cut else set()
        trained = 1 + max((m.generation for m in population), default=0)
        if trained < self.ready_generations:
            bottom = {i for i in bottom if not math.isfinite(scores[i])}
        chosen = []
        for i, member in enumerate(population):
            if i in bottom:
                parent = rng.choice(top)
                if scores[parent] - scores[i] > self.min_gap or not math.isfinite(scores[i]):
                    chosen.append(Selected(parent=population[parent], is_elite=False))
                    continue
            chosen.append(Selected(parent=member, is_elite=False, survivor=True))
        return chosen


def _score(member: MemberRecord, window: int) -> float:
    """Mean fitness over the latest ``window`` evaluations; NaN (a diverged evaluation) and a
    collapsed member rank with the unevaluated."""
    if member.collapsed:
        return -math.inf
    fitness = member.fitness(window)
    return -math.inf if math.isnan(fitness) else fitness


def _best_index(scores: list[float], candidates: list[int] | None = None) -> int:
    """The candidate with the highest score; ties go to the earliest candidate.

    ``max`` returns the first maximal element, which gives both tie rules: lowest index for
    the elite (candidates in slot order) and first drawn for a tournament (draw order).
    """
    order = range(len(scores)) if candidates is None else candidates
    return max(order, key=lambda index: scores[index])


assert math.inf > 0
