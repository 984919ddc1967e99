"""Mutation of a selected parent's hyperparameters, with AgileRL semantics by default.

Each child either keeps its parent's hyperparameters ("none") or has one RL hyperparameter
perturbed ("rl_hp"), chosen with probabilities proportional to ``no_mutation`` and ``rl_hp``
(so ``no_mutation=1, rl_hp=0.6`` still mutates 0.6/1.6 of the time). With ``perturb="all"``
a mutated child has every searched hyperparameter perturbed at once, in name order (the
explore of the original PBT, Jaderberg et al. 2017, with ``no_mutation=0``); with
``perturb_survivors`` a survivor of truncation selection is explored too, not only the copies
(its lineage goes on with the changed values). A perturbation multiplies
the value by ``grow_factor`` or ``shrink_factor`` (even odds) or, with probability
``resample_probability``, draws a fresh value from the range; the result is clipped to the
range and cast to its dtype. Architecture mutations are not supported: the model is fixed.

A whole-number hyperparameter (``group_size``, ``prompts_per_step``; an ``int`` range) moves to
the nearest whole number on the side of its step, so a grow of 2 by 1.2 gives 3, not 2 again,
and only to a value that keeps the batch rules (``rule``: the group size the algorithm needs,
mini- and micro-batches dividing the batch, the global batch splitting over the member's
ranks); when no value on that side does, it keeps its value.

Every random choice goes through the ``random.Random`` passed in. Controller code: no torch.
"""

from __future__ import annotations

import random

from pbt.config.errors import ConfigError
from pbt.config.ranges import BatchRule, HPRange, mutation_problems, typed_range
from pbt.evolution.selection import Selected


class Mutations:
    """Perturbs one RL hyperparameter of a child, or none.

    Args:
        ranges: The mutable hyperparameters by name, and where each may go.
        no_mutation: Relative weight of leaving the child unchanged.
        rl_hp: Relative weight of perturbing one hyperparameter.
        mutate_elite: Whether the elite may be mutated too (AgileRL leaves it alone).
        resample_probability: Chance a perturbation draws a fresh value instead of scaling.
        rule: The batch rules a child's hyperparameters must keep
            (:func:`~pbt.config.ranges.batch_rule`); None checks none.
        perturb: ``"one"`` hyperparameter of a mutated child, drawn uniformly, or ``"all"``.
        perturb_survivors: Whether a survivor of truncation selection is mutated too.

    Raises:
        ConfigError: Listing every argument that breaks a rule.
    """

    def __init__(
        self,
        ranges: dict[str, HPRange],
        no_mutation: float = 0.4,
        rl_hp: float = 0.6,
        mutate_elite: bool = False,
        resample_probability: float = 0.0,
        *,
        rule: BatchRule | None = None,
        perturb: str = "one",
        perturb_survivors: bool = False,
    ) -> None:
        problems = mutation_problems(ranges, no_mutation, rl_hp, resample_probability)
        problems += explore_problems(perturb, perturb_survivors)
        if problems:
            raise ConfigError(problems)
        self.ranges = {name: typed_range(name, spec) for name, spec in ranges.items()}
        self.rule = rule
        self.no_mutation = no_mutation
        self.rl_hp = rl_hp
        self.mutate_elite = mutate_elite
        self.resample_probability = resample_probability
        self.perturb = perturb
        self.perturb_survivors = perturb_survivors

    def mutate(
        self,
        hyperparameters: dict[str, float],
        rng: random.Random,
        is_elite: bool = False,
        rule: BatchRule | None = None,
    ) -> tuple[dict[str, float], str]:
        """A child's hyperparameters and what was done, in words.

        Args:
            hyperparameters: The parent's values; not modified.
            rng: The campaign's seeded generator; the only source of randomness used.
            is_elite: Whether this child is the elite slot.
            rule: The batch rules to keep, instead of the ones given at construction.

        Returns:
            A new dict, and ``"none"``, ``"none (elite)"``, ``"lr x1.2 (0.001 -> 0.0012)"``
            or ``"lr resampled (0.001 -> 0.0004)"``; under ``perturb="all"`` one such part per
            hyperparameter, joined by ``"; "``.

        Raises:
            ConfigError: When an rl_hp mutation finds none of ``ranges`` in the parent's values.
        """
        child = dict(hyperparameters)
        if is_elite and not self.mutate_elite:
            return child, "none (elite)"
        if rng.random() * (self.no_mutation + self.rl_hp) < self.no_mutation:
            return child, "none"
        names = self._mutable_names(child)
        if self.perturb == "all":
            return child, "; ".join(self._perturb(child, n, rng, rule or self.rule) for n in names)
        return child, self._perturb(child, rng.choice(names), rng, rule or self.rule)

    def mutate_population(
        self, selected: list[Selected], rng: random.Random
    ) -> list[tuple[dict[str, float], str]]:
        """:meth:`mutate` applied to each selected parent, in order, with its elite flag; a
        survivor of truncation selection keeps its values (``"none (survivor)"``) unless
        ``perturb_survivors`` (then its description ends ``" (survivor)"``); a migrant of
        multi-frequency selection takes the values and description its selection set."""
        out = []
        for s in selected:
            if s.hyperparameters is not None:
                out.append((dict(s.hyperparameters), s.how or "none (migrant)"))
            elif s.survivor and not self.perturb_survivors:
                out.append((dict(s.parent.hyperparameters), "none (survivor)"))
            elif s.survivor:
                values, how = self.mutate(s.parent.hyperparameters, rng)
                out.append((values, f"{how} (survivor)"))
            else:
                out.append(self.mutate(s.parent.hyperparameters, rng, is_elite=s.is_elite))
        return out

    def _mutable_names(self, hyperparameters: dict[str, float]) -> list[str]:
        names = sorted(name for name in self.ranges if name in hyperparameters)
        if not names:
            raise ConfigError(
                [
                    f"mutation.ranges ({sorted(self.ranges)}) names none of the member's "
                    f"hyperparameters ({sorted(hyperparameters)}); rename the ranges to match"
                ]
            )
        return names

    def _perturb(
        self, child: dict[str, float], name: str, rng: random.Random, rule: BatchRule | None
    ) -> str:
        """Change ``child[name]`` in place; return the description."""
        spec = self.ranges[name]
        old = child[name]
        if rng.random() < self.resample_probability:
            how, raw, direction = "resampled", spec.resample(rng), 0
        else:
            factor = spec.grow_factor if rng.random() < 0.5 else spec.shrink_factor
            how, raw, direction = f"x{factor:g}", old * factor, (1 if factor > 1 else -1)
        if spec.dtype == "int":
            child[name] = spec.nearest_whole(
                raw, old, direction, lambda v: rule is None or not rule({**child, name: v})
            )
        else:
            child[name] = spec.clip_cast(raw)
        return f"{name} {how} ({old:.6g} -> {child[name]:.6g})"


def explore_problems(perturb: object, perturb_survivors: object) -> list[str]:
    """The rules of ``mutation.perturb`` and ``mutation.perturb_survivors``."""
    problems = []
    if perturb not in ("one", "all"):
        problems.append(
            f"mutation.perturb ({perturb!r}) must be 'one' or 'all'; use all for the original "
            "PBT's explore (every searched hyperparameter of a copy perturbed)"
        )
    if not isinstance(perturb_survivors, bool):
        problems.append(
            f"mutation.perturb_survivors ({perturb_survivors!r}) must be true or false; set a "
            "boolean"
        )
    return problems
