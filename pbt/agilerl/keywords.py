"""The keywords of AgileRL's LLM algorithm constructors (``GRPO(...)``, ``DPO(...)``, ...), read
into manifest sections and ``INIT_HP``.

AgileRL's constructors take dozens of keywords. Here each one is, in this order:

1. one of :mod:`pbt.agilerl.arguments`'s arguments (``lora_config``, ``vllm_config``,
   ``use_vllm``, ``accelerator``, ``actor_network``, ...), read there;
2. in :data:`KEYWORDS` below: set on a manifest path, warned about once (no effect here), or
   refused with the fix (ignoring it would change what trains);
3. otherwise a hyperparameter, in either case (``lr`` or ``LR``): an ``INIT_HP`` key, which the
   config translation maps (``batch_size`` is ``algorithm.prompts_per_step``, ...) or refuses
   with the nearest known key. An ``INIT_HP`` key that only earns a note there
   (``calc_position_embeddings``, ``use_liger_loss``, ...) is warned about here instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from pbt.config.agilerl.rules import INIT_HP_RULES, Outcome


def _to(path: str) -> Callable[[Any], Outcome]:
    return lambda value: Outcome(sets=((path, value),))


def _noop(why: str) -> Callable[[Any], Outcome]:
    return lambda value: Outcome(note=why)


def _only(allowed: tuple[Any, ...], why: str) -> Callable[[Any], Outcome]:
    """Silent for an allowed value (what this trainer does anyway); refused otherwise."""
    return lambda value: Outcome() if value in allowed else Outcome(problem=why)


def _importance_correction(value: Any) -> Outcome:
    return Outcome() if value else Outcome(sets=(("rollout.vllm.importance_cap", 0.0),))


KEYWORDS: dict[str, Callable[[Any], Outcome]] = {
    "top_p": _to("rollout.top_p"),
    "top_k": _to("rollout.top_k"),
    "gradient_checkpointing": _to("training.activation_checkpointing"),
    "activation_offload": _to("training.activation_offloading"),
    "vllm_importance_sampling_cap": _to("rollout.vllm.importance_cap"),
    "vllm_importance_sampling_correction": _importance_correction,
    "index": _noop("agents are named by member id (agent.member_id)"),
    "wrap": _noop("members are not wrapped by Accelerate; torchrun ranks make the group"),
    "clone": _noop("use agent.clone()"),
    "hf_generate_chunk_size": _noop("generate takes a member's prompts in one batch"),
    "cast_logprobs_to_fp32": _noop("log-probs are always reduced in float32 here"),
    "chunk_rows": _noop("log-probs are computed in the project's own chunks"),
    "use_sequence_packing": _noop("batches are padded here"),
    "turn_advantage_trajectory_fallback": _noop("advantages are per trajectory here"),
    "min_p": _only((0, 0.0), "is not supported: sampling has no min-p filter here; set 0"),
    "repetition_penalty": _only(
        (1, 1.0), "is not supported: the trainer's log-probs model no penalty; set 1.0"
    ),
    "whiten_advantages": _only((False,), "is not supported: advantages are per group; set False"),
    "adv_clip_range": _only((None,), "is not supported: advantages are not clipped; set None"),
    "adv_filter_eps": _only(
        (0, 0.0), "is not supported: groups without signal are dropped as a whole; set 0"
    ),
    "loss_norm": _only(
        ("micro_batch",),
        "is not supported: the loss averages as algorithm.loss_aggregation says; drop it",
    ),
    "importance_sampling_level": _only(
        (None, "token"),
        "is not supported: sequence-level ratios are GSPO (use GSPO or loss_type='gspo')",
    ),
    "advantage_granularity": _only(
        ("auto", "trajectory"), "is not supported: advantages are per trajectory; set 'auto'"
    ),
    "action_granularity": _only((None, "auto", "trajectory"), "is deprecated in AgileRL; drop it"),
    "lora_target_scope": _only(
        (None,), "is not supported: name the modules in lora_config.target_modules"
    ),
    "mini_batch_size": _only(
        (None,),
        "is not supported as a keyword: pass config={'algorithm': {'mini_batch_size': N}} "
        "(completions per optimizer step)",
    ),
    "model_config": _only(
        (None, {}),
        "is not supported: pass config={'model': {'dtype': ...}} for the model's settings",
    ),
    "quantization_config": _only(
        (None,),
        "is not supported as an object: pass config={'model': {'quantization': {'quant_type': "
        "'nf4'}}} (QLoRA)",
    ),
}
"""AgileRL constructor keywords that are not ``INIT_HP`` keys, and what each becomes."""


def read_keywords(
    keywords: dict[str, Any], where: str
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], list[str]]:
    """Sort a constructor's keywords into manifest sections, ``INIT_HP`` and problems.

    Args:
        keywords: the keywords left after the agent's own (``model_name``, ``fsdp_config``,
            ...) and :mod:`pbt.agilerl.arguments`'s.
        where: the call, for messages (``GRPO``).

    Returns:
        ``(sections, init_hp, problems)``; one warning is issued per keyword with no effect.
    """
    sections: dict[str, dict[str, Any]] = {}
    init_hp: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in keywords.items():
        convert = KEYWORDS.get(key)
        if convert is None:
            rule = INIT_HP_RULES.get(key.upper())
            if rule is None or rule.targets:
                init_hp[key.upper()] = value  # mapped, or reported, by the config translation
                continue
            convert = rule.convert
        outcome = convert(value)
        for path, assigned in outcome.sets:
            _assign(sections, path, assigned)
        if outcome.note:
            warnings.warn(
                f"{where}({key}={value!r}) has no effect here: {outcome.note}", stacklevel=4
            )
        if outcome.problem:
            problems.append(f"{where}({key}={value!r}) {outcome.problem}")
    return sections, init_hp, problems


def _assign(sections: dict[str, Any], path: str, value: Any) -> None:
    *parents, name = path.split(".")
    block = sections
    for part in parents:
        block = block.setdefault(part, {})
    block[name] = value
