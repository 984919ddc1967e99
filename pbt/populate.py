"""Build a population from ``INIT_HP`` (or a manifest), and its selection and mutation.

``create_population`` is the public Python API; ``pbt run`` uses the same call. It loads no
model: it returns a :class:`~pbt.library.Population` of agents that materialise on one shared
base model when first used, and whose records the campaign controller stores.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from pbt.config import MUTABLE_BY_ALGORITHM, MUTABLE_HYPERPARAMETERS, Manifest
from pbt.errors import ConfigError
from pbt.library import Population
from pbt.manifest import manifest_from_dict
from pbt.mutation import HPRange, Mutations
from pbt.population import MemberRecord
from pbt.selection import TournamentSelection


def base_hyperparameters(manifest: Manifest) -> dict[str, float]:
    """The algorithm's mutable hyperparameters' starting values, as the manifest sets them."""
    return {
        name: getattr(getattr(manifest, MUTABLE_HYPERPARAMETERS[name]), name)
        for name in MUTABLE_BY_ALGORITHM[manifest.algorithm.name]
    }


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
        else:
            ranges[name] = HPRange(**spec)
    return ranges, problems


def build_selection(manifest: Manifest) -> TournamentSelection:
    """Tournament selection as the manifest's population section says."""
    pop = manifest.population
    return TournamentSelection(pop.tournament_size, pop.elitism, pop.size, pop.fitness_window)


def build_mutations(manifest: Manifest) -> Mutations:
    """Mutations as the manifest's mutation section says."""
    mut = manifest.mutation
    return Mutations(
        hp_ranges(manifest), mut.no_mutation, mut.rl_hp, mut.mutate_elite, mut.resample_probability
    )


def check_campaign(manifest: Manifest) -> list[str]:
    """Problems of the campaign sections that only the selection and mutation rules see."""
    problems: list[str] = []
    for build in (build_selection, build_mutations):
        try:
            build(manifest)
        except ConfigError as err:
            problems += err.problems
    return problems


def create_population(
    INIT_HP: dict[str, Any] | None = None,
    *,
    algo: str | None = None,
    manifest: Manifest | None = None,
    config: dict[str, Any] | None = None,
    population_size: int | None = None,
    hp_config: dict[str, dict[str, Any]] | None = None,
    init_sampler: str | None = None,
    model_name: str | None = None,
    device: str | None = None,
    rng: random.Random | None = None,
    storage: str | None = None,
) -> Population:
    """The population of generation 0: agents that load nothing until first used.

    Args:
        INIT_HP: AgileRL-style hyperparameters (``LR``, ``GROUP_SIZE``, ``POP_SIZE``, ``FSDP``
            as True or a dict of ``FSDPConfig`` fields, ...); used when ``manifest`` is not given.
        algo: the algorithm (``"GRPO"``); same as ``INIT_HP["ALGO"]``.
        manifest: a validated manifest (what ``pbt run`` passes).
        config: any other manifest sections (``{"task": {...}, "lora": {...}}``).
        population_size: overrides ``population.size``.
        hp_config: mutation ranges, ``{name: {min, max, ...}}``; overrides ``mutation.ranges``.
        init_sampler: ``none`` (every member starts from the manifest's values), ``random``,
            ``qmc`` (an evenly spread population) or ``tpe`` (informed by
            ``population.warm_start``): values drawn from the ranges through an Optuna study,
            log-uniformly where a range says so.
        model_name: the base model (``model.name``): a local folder, hub id or ``builtin:tiny``.
        device: ``auto``, ``cpu`` or ``cuda`` (``training.device``).
        rng: the generator evolution draws from in library mode; seeded from
            ``training.seed`` when omitted.
        storage: the Optuna storage that keeps the initial draws (a campaign passes its
            ``optuna.db``); default in memory.

    Raises:
        ConfigError: any bad key or value, all reported together.
    """
    if manifest is None:
        sections = {name: dict(values) for name, values in (config or {}).items()}
        init_hp = dict(INIT_HP or {})
        if algo is not None:
            init_hp["ALGO"] = algo
        for value, section, key in ((model_name, "model", "name"), (device, "training", "device")):
            if value is not None:
                sections.setdefault(section, {})[key] = value
        manifest = manifest_from_dict({**sections, "INIT_HP": init_hp})
    elif INIT_HP or config:
        raise ConfigError(
            [
                "create_population takes a manifest or INIT_HP/config, not both; fold the "
                "INIT_HP values into the manifest"
            ]
        )
    elif algo is not None and algo != manifest.algorithm.name:
        raise ConfigError(
            [
                f"algo ({algo!r}) contradicts the manifest's algorithm.name "
                f"({manifest.algorithm.name!r}); drop algo or change the manifest"
            ]
        )
    if manifest is not None and (model_name or device):
        manifest.model = dataclasses.replace(manifest.model, name=model_name or manifest.model.name)
        manifest.training = dataclasses.replace(
            manifest.training, device=device or manifest.training.device
        )
    if population_size is not None:
        manifest.population = dataclasses.replace(manifest.population, size=population_size)
    if hp_config is not None:
        manifest.mutation = dataclasses.replace(manifest.mutation, ranges=dict(hp_config))
    if init_sampler is not None:
        manifest.population = dataclasses.replace(manifest.population, init_sampler=init_sampler)
    problems = manifest.population.check("population") + check_campaign(manifest)
    if problems:
        raise ConfigError(problems)
    rng = rng or random.Random(manifest.training.seed)
    members = [
        MemberRecord(member_id=f"g000-m{i:02d}", generation=0, hyperparameters=values)
        for i, values in enumerate(initial_hyperparameters(manifest, storage))
    ]
    return Population(manifest, members, rng)


INIT_STUDY = "initial-population"
"""The Optuna study that holds a campaign's generation-0 draws and their fitness."""


def initial_hyperparameters(manifest: Manifest, storage: str | None) -> list[dict[str, float]]:
    """Generation 0's hyperparameters, one dict per member, as ``population.init_sampler`` says."""
    base = base_hyperparameters(manifest)
    pop = manifest.population
    ranges = hp_ranges(manifest)
    if pop.init_sampler == "none" or not ranges:
        return [dict(base) for _ in range(pop.size)]
    from pbt.search import sample_initial

    warm_start = None
    if pop.warm_start is not None:
        is_url = "://" in pop.warm_start
        warm_start = pop.warm_start if is_url else str(Path(manifest.base_dir) / pop.warm_start)
    return sample_initial(
        ranges,
        base,
        pop.size,
        sampler=pop.init_sampler,
        seed=manifest.training.seed,
        storage=storage,
        study_name=INIT_STUDY,
        warm_start=warm_start,
    )
