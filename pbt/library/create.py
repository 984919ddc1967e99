"""Build a population from ``INIT_HP`` (or a manifest), and its selection and mutation.

``create_population`` is the public Python API; ``pbt run`` uses the same call. It loads no
model: it returns a :class:`~pbt.library.Population` of agents that materialise on one shared
base model when first used, and whose records the campaign controller stores.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from pbt.config import Manifest
from pbt.config.errors import ConfigError
from pbt.config.loader import manifest_from_dict
from pbt.config.ranges import campaign_problems
from pbt.controller.population import initial_records
from pbt.library.population import Population


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
    problems = manifest.population.check("population") + campaign_problems(manifest)
    if problems:
        raise ConfigError(problems)
    rng = rng or random.Random(manifest.training.seed)
    members = initial_records(manifest, storage)
    return Population(manifest, members, rng)
