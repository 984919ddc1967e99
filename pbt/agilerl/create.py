"""``create_population`` in AgileRL's call shape as well as this package's own.

AgileRL builds a population with ``create_population(algo, net_config, INIT_HP, ...)``
(``agilerl.utils.utils``); this function binds such a call as AgileRL does, reads its extra
arguments into manifest sections (:mod:`pbt.agilerl.arguments`) and builds the population with
:func:`pbt.library.create.create_population`. A call in this package's own form (``INIT_HP``
or a manifest, by keyword) goes straight through. ``pbt.create_population`` is this function.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from pbt.agilerl.arguments import agilerl_sections, create_call
from pbt.config import Manifest
from pbt.config.errors import ConfigError
from pbt.library import create
from pbt.library.population import Agent, Population


def create_population(
    first: dict[str, Any] | str | None = None,
    /,
    *agilerl_args: Any,
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
    **agilerl_kwargs: Any,
) -> Population:
    """The population of generation 0: agents that load nothing until first used.

    AgileRL's call works: ``create_population("GRPO", None, INIT_HP, hp_config=...,
    population_size=4, tokenizer=..., lora_config=...)`` (its positional order and keyword
    names). Without ``population_size`` it builds ``INIT_HP["POP_SIZE"]`` members (AgileRL
    would build 1). Every other argument is :func:`pbt.library.create.create_population`'s.

    Args:
        first: ``INIT_HP`` given by position, or AgileRL's ``algo``.
        agilerl_args, agilerl_kwargs: the rest of AgileRL's call shape.
        (the rest): as :func:`pbt.library.create.create_population`.

    Raises:
        ConfigError: any bad key or value, all reported together.
    """
    ours = dict(
        manifest=manifest,
        config=config,
        init_sampler=init_sampler,
        rng=rng,
        storage=storage,
        agent_class=agent_class,
    )
    shared = {
        "INIT_HP": INIT_HP,
        "algo": algo,
        "hp_config": hp_config,
        "population_size": population_size,
        "model_name": model_name,
        "device": device,
    }
    if isinstance(first, str) or agilerl_args or agilerl_kwargs:
        args = (first, *agilerl_args) if first is not None else agilerl_args
        return _from_agilerl_call(args, shared | agilerl_kwargs, ours)
    return create.create_population(first, **shared, **ours)


_OWN_ARGS = ("algo", "INIT_HP", "hp_config", "population_size", "model_name", "device")
"""AgileRL's arguments that are ours too."""


def _from_agilerl_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], ours: dict[str, Any]
) -> Population:
    """``create_population`` called in AgileRL's shape: bind it as AgileRL does, read its
    extra arguments into sections, and build the population our way."""
    given = {key: value for key, value in kwargs.items() if value is not None}
    call = create_call(args, given | {k: v for k, v in kwargs.items() if k not in _OWN_ARGS})
    if ours["manifest"] is not None:
        raise ConfigError(
            [
                "create_population takes a manifest or AgileRL's (algo, net_config, INIT_HP), "
                "not both; fold the INIT_HP values into the manifest"
            ]
        )
    extras = {key: value for key, value in call.items() if key not in _OWN_ARGS}
    sections, init_hp = agilerl_sections(extras, "create_population")
    config = copy.deepcopy(ours["config"] or {})
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return create.create_population(
        {**(call.get("INIT_HP") or {}), **init_hp},
        algo=call.get("algo"),
        config=config,
        population_size=call.get("population_size"),
        hp_config=call.get("hp_config"),
        model_name=call.get("model_name"),
        device=call.get("device"),
        init_sampler=ours["init_sampler"],
        rng=ours["rng"],
        storage=ours["storage"],
        agent_class=ours["agent_class"],
    )
