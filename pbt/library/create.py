"""Build a population from ``INIT_HP`` (or a manifest).

:func:`create_population` loads no model: it returns a :class:`~pbt.library.population.Population`
of agents that materialise on one shared base model when first used. Its generation 0 is
:func:`pbt.evolution.breeding.initial_records`, the same records ``pbt run`` stores for a
campaign's first generation.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

from pbt.config import Manifest
from pbt.config.errors import ConfigError
from pbt.config.ranges import range_specs
from pbt.config.read.loader import manifest_from_dict
from pbt.evolution.breeding import initial_records
from pbt.library.population import Agent, Population


def create_population(
    first: dict[str, Any] | None = None,
    /,
    *,
    INIT_HP: dict[str, Any] | None = None,
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
    agent_class: type[Agent] = Agent,
) -> Population:
    """The population of generation 0: agents that load nothing until first used.

    AgileRL's positional form (``create_population("GRPO", None, INIT_HP, ...)``) is
    :func:`pbt.agilerl.create.create_population`, which ``pbt.create_population`` names.

    Args:
        first: ``INIT_HP`` given by position.
        INIT_HP: AgileRL-style hyperparameters (``LR``, ``GROUP_SIZE``, ``POP_SIZE``, ``FSDP``
            as True or a dict of ``FSDPConfig`` fields, ...); used when ``manifest`` is not given.
        algo: the algorithm (``"GRPO"``); same as ``INIT_HP["ALGO"]``.
        manifest: a validated manifest (what ``pbt run`` passes).
        config: any other manifest sections (``{"task": {...}, "lora": {...}}``).
        population_size: overrides ``population.size``.
        hp_config: mutation ranges, ``{name: {min, max, ...}}`` or AgileRL's
            ``HyperparameterConfig``; overrides ``mutation.ranges``.
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
        agent_class: the class of the agents (``GRPO.population`` passes ``GRPO``).

    Raises:
        ConfigError: any bad key or value, all reported together.
    """
    if first is not None and INIT_HP is not None:
        raise ConfigError(["create_population got INIT_HP twice (by position and by keyword)"])
    INIT_HP = first if first is not None else INIT_HP
    overrides = {
        ("model", "name"): model_name,
        ("training", "device"): device,
        ("population", "size"): population_size,
        ("mutation", "ranges"): None if hp_config is None else range_specs(hp_config),
        ("population", "init_sampler"): init_sampler,
    }
    overrides = {where: value for where, value in overrides.items() if value is not None}
    if manifest is None:
        manifest = manifest_from_dict(_sections(INIT_HP, algo, config, overrides))
    else:
        _refuse_contradictions(manifest, INIT_HP, algo, config)
        if overrides:
            manifest = _overridden(manifest, overrides)
    rng = rng or random.Random(manifest.training.seed)
    members = initial_records(manifest, storage)
    return Population(manifest, members, rng, agent_class)


def _sections(
    init_hp: dict[str, Any] | None,
    algo: str | None,
    config: dict[str, Any] | None,
    overrides: dict[tuple[str, str], Any],
) -> dict[str, Any]:
    """The manifest sections of the ``INIT_HP`` form, copied: the keyword arguments win over
    ``config`` and over ``INIT_HP["POP_SIZE"]``."""
    sections = copy.deepcopy(config or {})
    init_hp = dict(init_hp or {})
    if algo is not None:
        init_hp["ALGO"] = algo
    if ("population", "size") in overrides:
        init_hp.pop("POP_SIZE", None)
    for (section, key), value in overrides.items():
        block = sections.setdefault(section, {})
        if isinstance(block, dict):  # a section that is not a mapping is reported by the loader
            block[key] = value
    return {**sections, "INIT_HP": init_hp}


def _refuse_contradictions(
    manifest: Manifest,
    init_hp: dict[str, Any] | None,
    algo: str | None,
    config: dict[str, Any] | None,
) -> None:
    if init_hp or config:
        raise ConfigError(
            [
                "create_population takes a manifest or INIT_HP/config, not both; fold the "
                "INIT_HP values into the manifest"
            ]
        )
    if algo is not None and algo != manifest.algorithm.name:
        raise ConfigError(
            [
                f"algo ({algo!r}) contradicts the manifest's algorithm.name "
                f"({manifest.algorithm.name!r}); drop algo or change the manifest"
            ]
        )


def _overridden(manifest: Manifest, overrides: dict[tuple[str, str], Any]) -> Manifest:
    """A new manifest: ``manifest`` with the overrides, validated as a whole like a file.
    The caller's manifest is left as it was."""
    sections = dataclasses.asdict(manifest)
    base_dir = sections.pop("base_dir")
    notes = sections.pop("translation_notes")
    for (section, key), value in overrides.items():
        sections[section][key] = value
    overridden = manifest_from_dict(sections, base_dir=base_dir)
    overridden.translation_notes.extend(notes)
    return overridden
