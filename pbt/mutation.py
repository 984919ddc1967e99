"""Mutation of a selected parent's hyperparameters, with AgileRL semantics.

Each child either keeps its parent's hyperparameters ("none") or has one RL hyperparameter
perturbed ("rl_hp"), chosen with probabilities proportional to ``no_mutation`` and ``rl_hp``
(so ``no_mutation=1, rl_hp=0.6`` still mutates 0.6/1.6 of the time). A perturbation multiplies
the value by ``grow_factor`` or ``shrink_factor`` (even odds) or, with probability
``resample_probability``, draws a fresh value from the range; the result is clipped to the
range and cast to its dtype. Architecture mutations are not supported: the model is fixed.

Every random choice goes through the ``random.Random`` passed in. Controller code: no torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from pbt.errors import ConfigError
from pbt.selection import Selected


@dataclass(kw_only=True, slots=True)
class HPRange:
    """Where one hyperparameter may go and how it moves."""

    min: float
    """Smallest allowed value; results are clipped up to it."""
    max: float
    """Largest allowed value; results are clipped down to it."""
    grow_factor: float = 1.2
    """Multiplier for an upward step; must be > 1."""
    shrink_factor: float = 0.8
    """Multiplier for a downward step; must be in (0, 1)."""
    log: bool = False
    """Resample log-uniformly (for scales such as learning rates); needs ``min > 0``."""
    dtype: Literal["float", "int"] = "float"
    """``int`` rounds every result to the nearest integer."""

    def check(self, key: str) -> list[str]:
        """Problems with this range, each naming ``key.<field>``, the value, rule and fix.

        Args:
            key: Dotted path of this range in the config, e.g. ``mutation.ranges.lr``.
        """
        fields = (self.min, self.max, self.grow_factor, self.shrink_factor)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in fields):
            return [
                f"{key} (min={self.min!r}, max={self.max!r}, grow_factor={self.grow_factor!r}, "
                f"shrink_factor={self.shrink_factor!r}) must all be finite numbers; fix them"
            ]
        problems = []
        if self.min >= self.max:
            problems.append(
                f"{key}.min ({self.min}) must be < {key}.max ({self.max}); lower min or raise max"
            )
        if self.log and self.min <= 0:
            problems.append(
                f"{key}.min ({self.min}) must be > 0 when log is true; raise min or set log: false"
            )
        if not 0 < self.shrink_factor < 1:
            problems.append(
                f"{key}.shrink_factor ({self.shrink_factor}) must be in (0, 1); use e.g. 0.8"
            )
        if not self.grow_factor > 1:
            problems.append(f"{key}.grow_factor ({self.grow_factor}) must be > 1; use e.g. 1.2")
        if self.dtype not in ("float", "int"):
            problems.append(f"{key}.dtype ({self.dtype!r}) must be 'float' or 'int'; pick one")
        return problems

    def clip_cast(self, value: float) -> float | int:
        """``value`` clipped to ``[min, max]``, rounded to an int when ``dtype`` is ``int``."""
        clipped = min(max(value, self.min), self.max)
        return round(clipped) if self.dtype == "int" else float(clipped)

    def resample(self, rng: random.Random) -> float:
        """A fresh value from the range: uniform, or log-uniform when ``log`` is set."""
        if self.log:
            return math.exp(rng.uniform(math.log(self.min), math.log(self.max)))
        return rng.uniform(self.min, self.max)


class Mutations:
    """Perturbs one RL hyperparameter of a child, or none.

    Args:
        ranges: The mutable hyperparameters by name, and where each may go.
        no_mutation: Relative weight of leaving the child unchanged.
        rl_hp: Relative weight of perturbing one hyperparameter.
        mutate_elite: Whether the elite may be mutated too (AgileRL leaves it alone).
        resample_probability: Chance a perturbation draws a fresh value instead of scaling.

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
    ) -> None:
        problems = _check_probabilities(no_mutation, rl_hp, resample_probability)
        if not ranges and isinstance(rl_hp, (int, float)) and rl_hp > 0:
            problems.append(
                f"mutation.ranges ({ranges!r}) must name at least one hyperparameter when "
                f"mutation.rl_hp ({rl_hp}) > 0; add a range or set rl_hp: 0"
            )
        for name in sorted(ranges):
            problems += ranges[name].check(f"mutation.ranges.{name}")
        if problems:
            raise ConfigError(problems)
        self.ranges = dict(ranges)
        self.no_mutation = no_mutation
        self.rl_hp = rl_hp
        self.mutate_elite = mutate_elite
        self.resample_probability = resample_probability

    def mutate(
        self, hyperparameters: dict[str, float], rng: random.Random, is_elite: bool = False
    ) -> tuple[dict[str, float], str]:
        """A child's hyperparameters and what was done, in words.

        Args:
            hyperparameters: The parent's values; not modified.
            rng: The campaign's seeded generator; the only source of randomness used.
            is_elite: Whether this child is the elite slot.

        Returns:
            A new dict, and ``"none"``, ``"none (elite)"``, ``"lr x1.2 (0.001 -> 0.0012)"``
            or ``"lr resampled (0.001 -> 0.0004)"``.

        Raises:
            ConfigError: When an rl_hp mutation finds none of ``ranges`` in the parent's values.
        """
        child = dict(hyperparameters)
        if is_elite and not self.mutate_elite:
            return child, "none (elite)"
        if rng.random() * (self.no_mutation + self.rl_hp) < self.no_mutation:
            return child, "none"
        name = rng.choice(self._mutable_names(child))
        return child, self._perturb(child, name, rng)

    def mutate_population(
        self, selected: list[Selected], rng: random.Random
    ) -> list[tuple[dict[str, float], str]]:
        """:meth:`mutate` applied to each selected parent, in order, with its elite flag."""
        return [self.mutate(s.parent.hyperparameters, rng, is_elite=s.is_elite) for s in selected]

    def mutation(self, population, rng: random.Random | None = None):
        """AgileRL's call on a library-mode population: each agent keeps or changes one
        hyperparameter (the elite as ``mutate_elite`` says), in place; returns the population.

        Args:
            population: A ``Population`` (or any agents with ``hyperparameters``,
                ``set_hyperparameters``, ``is_elite`` and ``mutation``).
            rng: The generator to draw from; default the population's own.
        """
        rng = rng or population.rng
        for agent in population:
            values, how = self.mutate(agent.hyperparameters, rng, is_elite=agent.is_elite)
            agent.set_hyperparameters(values)
            agent.mutation = how
        return population

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

    def _perturb(self, child: dict[str, float], name: str, rng: random.Random) -> str:
        """Change ``child[name]`` in place; return the description."""
        spec = self.ranges[name]
        old = child[name]
        if rng.random() < self.resample_probability:
            how, raw = "resampled", spec.resample(rng)
        else:
            factor = spec.grow_factor if rng.random() < 0.5 else spec.shrink_factor
            how, raw = f"x{factor:g}", old * factor
        child[name] = spec.clip_cast(raw)
        return f"{name} {how} ({old:.6g} -> {child[name]:.6g})"


def _check_probabilities(no_mutation: float, rl_hp: float, resample: float) -> list[str]:
    problems = []
    for key, value in (
        ("no_mutation", no_mutation),
        ("rl_hp", rl_hp),
        ("resample_probability", resample),
    ):
        if not isinstance(value, (int, float)) or not 0 <= value <= 1:
            problems.append(
                f"mutation.{key} ({value!r}) must be a probability in [0, 1]; set {key} in [0, 1]"
            )
    if not problems and no_mutation + rl_hp <= 0:
        problems.append(
            f"mutation.no_mutation ({no_mutation}) + mutation.rl_hp ({rl_hp}) must be > 0; "
            "raise one of them"
        )
    return problems
