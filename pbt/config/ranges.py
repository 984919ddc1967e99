"""Hyperparameter ranges: where each mutable hyperparameter may go and how it moves."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pbt.config.errors import ConfigError
from pbt.config.manifest import Manifest
from pbt.config.sections.algorithm import (
    INTEGER_HYPERPARAMETERS,
    MUTABLE_BY_ALGORITHM,
    MUTABLE_HYPERPARAMETERS,
)
from pbt.config.sections.campaign import selection_problems


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

    def nearest_whole(
        self, raw: float, old: float, direction: int, allowed: Callable[[int], bool]
    ) -> int:
        """The whole number in the range nearest ``raw`` that ``allowed`` accepts, on the
        side of ``old`` that ``direction`` says (+1: above it, -1: below it, 0: anywhere), so
        a grow or shrink of a small integer moves it at least one step; ``old`` (as an int)
        when no such number is allowed. Ties go to the smaller number.
        """
        low, high = math.ceil(self.min), math.floor(self.max)
        if direction > 0:
            low = max(low, math.floor(old) + 1)
        elif direction < 0:
            high = min(high, math.ceil(old) - 1)
        target = min(max(raw, low), high)
        for value in sorted(range(low, high + 1), key=lambda v: (abs(v - target), v)):
            if allowed(value):
                return value
        return round(old)

    def resample(self, rng: random.Random) -> float:
        """A fresh value from the range: uniform, or log-uniform when ``log`` is set."""
        if self.log:
            return math.exp(rng.uniform(math.log(self.min), math.log(self.max)))
        return rng.uniform(self.min, self.max)


def base_hyperparameters(manifest: Manifest) -> dict[str, float]:
    """The algorithm's mutable hyperparameters' starting values, as the manifest sets them."""
    return {
        name: getattr(getattr(manifest, MUTABLE_HYPERPARAMETERS[name]), name)
        for name in MUTABLE_BY_ALGORITHM[manifest.algorithm.name]
    }


def typed_range(name: str, spec: HPRange) -> HPRange:
    """``spec`` as the range of hyperparameter ``name``: an ``int`` range for a whole-number
    hyperparameter (``group_size``, ``prompts_per_step``), unchanged otherwise."""
    if name in INTEGER_HYPERPARAMETERS and spec.dtype != "int":
        return dataclasses.replace(spec, dtype="int")
    return spec


BatchRule = Callable[[dict[str, float]], list[str]]
"""A member's hyperparameters -> the batch rules they break (none: they may be used)."""


def batch_rule(manifest: Manifest, ranks: int | None = None) -> BatchRule:
    """The rules a member's ``group_size`` and ``prompts_per_step`` must keep with the rest of
    ``manifest`` (``AlgorithmConfig.batch_problems``: group sizes, mini- and micro-batches, and
    the global batch splitting over ``ranks`` ranks, default the member's launch ranks)."""
    algorithm, world = manifest.algorithm, ranks or manifest.launch.ranks

    def problems(values: dict[str, float]) -> list[str]:
        whole = {k: round(v) for k, v in values.items() if k in INTEGER_HYPERPARAMETERS}
        return dataclasses.replace(algorithm, **whole).batch_problems(world)

    return problems


def keep_batch_rule(
    values: dict[str, float], ranges: dict[str, HPRange], rule: BatchRule
) -> dict[str, float]:
    """``values`` with each whole-number hyperparameter that breaks ``rule`` moved to the
    nearest value of its range that keeps it (drawn values, such as an initial sampler's)."""
    kept = dict(values)
    for name in sorted(INTEGER_HYPERPARAMETERS & set(kept) & set(ranges)):
        if rule(kept):
            value = kept[name]
            kept[name] = ranges[name].nearest_whole(
                value, value, 0, lambda v, n=name: not rule({**kept, n: v})
            )
    return kept


def hp_ranges(manifest: Manifest) -> dict[str, HPRange]:
    """The mutation ranges of the manifest, typed and checked.

    Raises:
        ConfigError: a range names a hyperparameter that cannot mutate, or has bad fields.
    """
    ranges, problems = _typed_ranges(manifest)
    for name, r in sorted(ranges.items()):
        problems += r.check(f"mutation.ranges.{name}")
    if problems:
        raise ConfigError(problems)
    return ranges


def _typed_ranges(manifest: Manifest) -> tuple[dict[str, HPRange], list[str]]:
    problems: list[str] = []
    ranges: dict[str, HPRange] = {}
    fields = {f.name for f in dataclasses.fields(HPRange)}
    optional = ", ".join(sorted(fields - {"min", "max"}))
    for name, spec in manifest.mutation.ranges.items():
        key = f"mutation.ranges.{name}"
        mutable = MUTABLE_BY_ALGORITHM[manifest.algorithm.name]
        if name not in mutable:
            problems.append(
                f"{key} is not a mutable hyperparameter of {manifest.algorithm.name}; "
                f"mutable: {', '.join(mutable)}"
            )
        elif not isinstance(spec, dict) or not {"min", "max"} <= set(spec) or set(spec) - fields:
            problems.append(
                f"{key} ({spec!r}) must be a mapping with min and max (optional: {optional})"
            )
        elif name in INTEGER_HYPERPARAMETERS and spec.get("dtype", "int") != "int":
            problems.append(
                f"{key}.dtype ({spec['dtype']!r}) must be 'int': {name} is a whole number; "
                "remove dtype"
            )
        else:
            ranges[name] = typed_range(name, HPRange(**spec))
    return ranges, problems


def _whole_range_problems(manifest: Manifest, ranges: dict[str, HPRange]) -> list[str]:
    """A whole-number range must hold a value that keeps the batch rules."""
    rule, base = batch_rule(manifest), base_hyperparameters(manifest)
    problems = []
    for name in sorted(INTEGER_HYPERPARAMETERS & set(ranges)):
        r = ranges[name]
        values = range(math.ceil(r.min), math.floor(r.max) + 1)
        if not any(not rule({**base, name: v}) for v in values):
            why = rule({**base, name: values[0]})[0] if values else "it holds no whole number"
            problems.append(
                f"mutation.ranges.{name} (min={r.min}, max={r.max}) holds no value the batch "
                f"rules allow (at min: {why}); widen the range"
            )
    return problems


def probability_problems(no_mutation: float, rl_hp: float, resample: float) -> list[str]:
    """The rules of the mutation probabilities, each naming its ``mutation.`` key."""
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


def mutation_problems(
    ranges: dict[str, HPRange], no_mutation: float, rl_hp: float, resample_probability: float
) -> list[str]:
    """The rules of mutation's arguments: probabilities, and ranges to mutate when it mutates."""
    problems = probability_problems(no_mutation, rl_hp, resample_probability)
    if not ranges and isinstance(rl_hp, (int, float)) and rl_hp > 0:
        problems.append(
            f"mutation.ranges ({ranges!r}) must name at least one hyperparameter when "
            f"mutation.rl_hp ({rl_hp}) > 0; add a range or set rl_hp: 0"
        )
    for name in sorted(ranges):
        problems += ranges[name].check(f"mutation.ranges.{name}")
    return problems


def campaign_problems(manifest: Manifest) -> list[str]:
    """Problems of the campaign sections that involve more than one field: the tournament
    against the population, and the mutation ranges against the algorithm."""
    pop, mut = manifest.population, manifest.mutation
    problems = selection_problems(pop.tournament_size, pop.elitism, pop.size, pop.fitness_window)
    if manifest.search.strategy == "pb2" and pop.selection != "truncation":
        problems.append(
            f"search.strategy (pb2) explores the copies that truncation selection makes, but "
            f"population.selection is {pop.selection!r}; set population.selection: truncation"
        )
    ranges, range_problems = _typed_ranges(manifest)
    if range_problems:
        return problems + range_problems
    problems += mutation_problems(ranges, mut.no_mutation, mut.rl_hp, mut.resample_probability)
    return problems or _whole_range_problems(manifest, ranges)


@dataclass(kw_only=True, slots=True)
class RLParameter:
    """AgileRL's spelling of one mutation range (``agilerl.algorithms.core.registry``): the
    same fields as :class:`HPRange` less ``log``, with ``dtype`` given as the type ``float``
    or ``int``."""

    min: float
    """Smallest allowed value."""
    max: float
    """Largest allowed value."""
    shrink_factor: float = 0.8
    """Multiplier for a downward step."""
    grow_factor: float = 1.2
    """Multiplier for an upward step."""
    dtype: type = float
    """``float`` or ``int`` (the type itself, as AgileRL writes it)."""

    def spec(self, key: str) -> dict[str, object]:
        """This range as a ``mutation.ranges`` entry.

        Raises:
            ConfigError: ``dtype`` is neither ``float`` nor ``int``.
        """
        if self.dtype not in (float, int):
            raise ConfigError(
                [
                    f"{key}.dtype ({self.dtype!r}) must be float or int; array-valued "
                    "hyperparameters do not exist for LLM fine-tuning, use one of the two"
                ]
            )
        return {
            "min": self.min,
            "max": self.max,
            "grow_factor": self.grow_factor,
            "shrink_factor": self.shrink_factor,
            "dtype": self.dtype.__name__,
        }


class HyperparameterConfig(dict):
    """AgileRL's ``hp_config``: the mutable hyperparameters by name, each an
    :class:`RLParameter` (``HyperparameterConfig(lr=RLParameter(min=1e-6, max=1e-4))``).
    Wherever ``hp_config`` is taken, it means the same as ``mutation.ranges``.

    Raises:
        ConfigError: a value is not an :class:`RLParameter`.
    """

    def __init__(self, **params: RLParameter) -> None:
        wrong = [name for name, value in params.items() if not isinstance(value, RLParameter)]
        if wrong:
            raise ConfigError(
                [
                    f"HyperparameterConfig.{name} ({params[name]!r}) must be an RLParameter; "
                    f"write {name}=RLParameter(min=..., max=...)"
                    for name in wrong
                ]
            )
        super().__init__(params)

    def names(self) -> list[str]:
        """The hyperparameters it names, in order."""
        return list(self)


def range_specs(hp_config: dict[str, object]) -> dict[str, object]:
    """``hp_config`` as ``mutation.ranges``: :class:`RLParameter` and :class:`HPRange` values
    become mappings; mappings pass as they are (the loader checks them)."""
    specs: dict[str, object] = {}
    for name, value in hp_config.items():
        if isinstance(value, RLParameter):
            specs[name] = value.spec(f"hp_config.{name}")
        elif isinstance(value, HPRange):
            specs[name] = dataclasses.asdict(value)
        else:
            specs[name] = value
    return specs
