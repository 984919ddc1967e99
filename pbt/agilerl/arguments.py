"""AgileRL's call shapes for building a population, read into this package's arguments.

AgileRL builds an LLM population with ``create_population(algo, net_config, INIT_HP, ...)``
(``agilerl.utils.utils``) or ``GRPO.population(size, accelerator, ..., lora_config=...,
vllm_config=..., pad_token_id=..., **hyperparameters)``. Their arguments fall in three kinds:

- mapped, with AgileRL's meaning: ``tokenizer`` (its pad token), ``lora_config`` (the
  ``lora`` section), ``use_vllm`` and ``vllm_config`` (the ``rollout`` section, as
  :mod:`pbt.agilerl.vllm_config` reads it; Hugging Face ``generate`` with one warning where
  vLLM is not installed), ``algo_kwargs`` (more ``INIT_HP``), ``hp_config``
  (``mutation.ranges``);
- harmless here, so one warning each when set: ``accelerator`` (members run under torchrun),
  ``torch_compiler``, ``num_envs`` other than 1;
- refused with one line, because obeying them is impossible and ignoring them would change
  what trains: network objects and configs, spaces, agent wrappers, ``resume_from_checkpoint``.
"""

from __future__ import annotations

import warnings
from typing import Any

from pbt.agilerl.vllm_config import rollout_section, vllm_config_from, vllm_engine
from pbt.config.errors import ConfigError

CREATE_POSITIONAL = (
    "algo", "net_config", "INIT_HP", "observation_space", "action_space", "hp_config",
    "actor_network", "critic_network", "agent_wrapper", "wrapper_kwargs", "population_size",
    "num_envs", "device", "accelerator", "torch_compiler", "tokenizer", "model_name",
    "lora_config", "vllm_config", "algo_kwargs",
)  # fmt: skip
"""The parameters of AgileRL's ``create_population``, in their positional order."""

REFUSED = {
    "net_config": "an LLM member has no network config: name the model (model_name) and "
    "shape the adapter with lora_config",
    "observation_space": "LLM members read prompts from the task section; drop it",
    "action_space": "LLM members write tokens; drop it",
    "actor_network": "members share one base model loaded by name; pass model_name (a folder "
    "or hub id) instead of a model object",
    "critic_network": "PPO's value head is built on the shared base; drop it",
    "agent_wrapper": "members are plain agents of a Population; drop it",
    "wrapper_kwargs": "members are plain agents of a Population; drop it",
    "resume_from_checkpoint": "call agent.load_checkpoint(path) on each agent, or resume "
    "train_population/finetune_llm from its output_dir",
}
"""AgileRL arguments that cannot be obeyed here, and what to do instead."""

HARMLESS = {
    "accelerator": "members run under torchrun, not Accelerate: set distributed.* (FSDP) and "
    "launch.nproc_per_member instead",
    "torch_compiler": "set rollout.compile to compile generation",
    "num_envs": "prompts per step are algorithm.prompts_per_step",
}
"""AgileRL arguments with no effect here, that change nothing about what trains."""

_DEFAULTS = {"num_envs": 1}

EXTRAS = frozenset(
    {*REFUSED, *HARMLESS, "tokenizer", "lora_config", "use_vllm", "vllm_config", "algo_kwargs"}
)
"""Every AgileRL argument :func:`agilerl_sections` reads."""


def create_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """AgileRL's ``create_population`` arguments, bound to their names as AgileRL would.

    Raises:
        ConfigError: too many positional arguments, an unknown keyword, or one given twice.
    """
    if len(args) > len(CREATE_POSITIONAL):
        raise ConfigError(
            [
                f"create_population takes at most {len(CREATE_POSITIONAL)} positional "
                f"arguments in AgileRL's order, got {len(args)}; pass the rest by keyword"
            ]
        )
    bound = dict(zip(CREATE_POSITIONAL, args, strict=False))
    problems = [
        f"create_population got {key} twice (by position and by keyword); pass it once"
        for key in kwargs
        if key in bound
    ]
    problems += [
        f"create_population has no argument {key!r}; AgileRL's are {', '.join(CREATE_POSITIONAL)}"
        for key in kwargs
        if key not in CREATE_POSITIONAL and key not in REFUSED
    ]
    if problems:
        raise ConfigError(problems)
    return bound | kwargs


def agilerl_sections(extras: dict[str, Any], where: str) -> tuple[dict[str, dict], dict]:
    """Manifest sections and ``INIT_HP`` entries for AgileRL's extra arguments.

    Args:
        extras: the arguments this package has no own keyword for (``lora_config``, ...).
        where: the call, for messages (``create_population``, ``GRPO.population``).

    Returns:
        ``(sections, init_hp)`` to merge into the call's ``config`` and ``INIT_HP``.

    Raises:
        ConfigError: every refused or unknown argument, all together.
    """
    sections: dict[str, dict] = {}
    init_hp: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in extras.items():
        if value is None or _DEFAULTS.get(key, object()) == value:
            continue
        if key in REFUSED:
            problems.append(f"{where}({key}={_short(value)}) is not supported: {REFUSED[key]}")
        elif key in HARMLESS:
            warnings.warn(f"{where}({key}=...) has no effect here: {HARMLESS[key]}", stacklevel=4)
        elif key == "tokenizer":
            model = sections.setdefault("model", {})
            model["pad_token_id"] = value.pad_token_id
            model["pad_token"] = value.pad_token
        elif key == "lora_config":
            problems += _lora(value, sections, where)
        elif key in ("use_vllm", "vllm_config"):
            continue  # read together below: one engine, one warning
        elif key == "algo_kwargs":
            init_hp |= {str(k).upper(): v for k, v in dict(value).items()}
        else:
            problems.append(f"{where} has no argument {key!r}")
    problems += _rollout(extras.get("use_vllm"), extras.get("vllm_config"), sections, where)
    if problems:
        raise ConfigError(problems)
    return sections, init_hp


def _rollout(use_vllm: Any, vllm_config: Any, sections: dict[str, dict], where: str) -> list[str]:
    """``use_vllm`` and ``vllm_config`` as the ``rollout`` section: a ``vllm_config`` asks for
    vLLM unless ``use_vllm`` is False (AgileRL: ``use_vllm=True`` or a ``vllm_config``)."""
    if vllm_config is not None and use_vllm is not False:
        config = vllm_config_from(vllm_config, where)
        rollout, problems = rollout_section(config, where)
        sections.setdefault("rollout", {}).update(rollout)
        return problems
    if use_vllm is not None:
        sections.setdefault("rollout", {})["engine"] = vllm_engine(where) if use_vllm else "hf"
    return []


def _lora(value: Any, sections: dict[str, dict], where: str) -> list[str]:
    """peft's ``LoraConfig`` (or a dict of its fields) as the ``lora`` section."""
    fields = value if isinstance(value, dict) else vars(value)
    names = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout"}
    lora = {ours: fields[theirs] for theirs, ours in names.items() if theirs in fields}
    targets = fields.get("target_modules")
    if targets is not None:
        lora["target_modules"] = targets if isinstance(targets, str) else sorted(targets)
    sections["lora"] = lora
    bias = fields.get("bias", "none")
    if bias != "none":
        return [f"{where}(lora_config.bias={bias!r}) is not supported: adapters train no bias"]
    return []


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"<{type(value).__name__}>"
