"""Rollouts: the engine that samples completions and its settings (HF, static, vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pbt.config.rules import (
    PositiveFloat,
    PositiveInt,
    Seconds,
    above_zero,
    at_least_zero,
    bound_problems,
)
from pbt.config.sections.algorithm import GROUP_ALGORITHMS
from pbt.config.sections.model import Dtype

VLLM_OWN_KEYS = (
    "model",
    "tokenizer",
    "enable_lora",
    "max_lora_rank",
    "max_loras",
    "seed",
    "logprobs_mode",
    "distributed_executor_backend",
    "enable_sleep_mode",
)
"""Engine arguments the vLLM rollout sets itself; ``engine_kwargs`` may not override them."""


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    """The colocated vLLM engine of ``rollout.engine: vllm``: one per process, sharing the
    device with training, serving the adapter of every member the process holds."""

    gpu_memory_utilization: float = 0.3
    """Share of each GPU vLLM may take for weights and KV cache; the rest is training's."""
    tensor_parallel_size: PositiveInt = 1
    """1: each rank runs its own engine on its share of the prompts. The member's rank count:
    one engine sharded over all of them (every rank sees every completion)."""
    max_num_seqs: PositiveInt = 256
    """Sequences decoded at once."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + completion in tokens; default the model's own limit."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (a group's completions share their prompt)."""
    sleep_mode: bool = True
    """Free the KV cache and offload the weights while the optimizer runs, where the platform
    supports it (CUDA); ignored, with a note in the log, where it does not (CPU)."""
    dtype: Dtype = "auto"
    """The engine's dtype; ``auto`` follows ``model.dtype``."""
    enforce_eager: bool = False
    """Skip CUDA graph capture: slower decoding, faster start, less memory."""
    importance_cap: Annotated[float, at_least_zero("0 turns the correction off; 2 is usual")] = 2.0
    """Cap of the truncated importance weight ``min(p_trainer / p_vllm, cap)`` that corrects
    each token's loss for the small numeric gap between vLLM's sampler and the trainer; 0 turns
    the correction off."""
    cpu_kv_cache_gib: PositiveFloat = 1.0
    """KV cache size on CPU (vLLM's ``VLLM_CPU_KVCACHE_SPACE``); unused on GPU."""
    engine_kwargs: dict[str, object] = field(default_factory=dict)
    """Anything else, passed to ``vllm.LLM`` as keyword arguments."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append(
                f"{prefix}.gpu_memory_utilization ({self.gpu_memory_utilization}) must be in "
                "(0, 1]; colocated with training, 0.2 to 0.5 is usual"
            )
        for key in self.engine_kwargs:
            if key in VLLM_OWN_KEYS:
                problems.append(
                    f"{prefix}.engine_kwargs.{key} is set by the vLLM rollout itself and cannot "
                    "be overridden; remove it"
                )
            elif key in VLLM_FIELDS:
                problems.append(
                    f"{prefix}.engine_kwargs.{key} has its own field; set {prefix}.{key} instead"
                )
        return problems


VLLM_FIELDS = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
    "dtype",
    "enforce_eager",
)
"""The :class:`VLLMConfig` fields passed to ``vllm.LLM`` under their own names."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How completions are sampled."""

    engine: Literal["hf", "static", "vllm"] = "hf"
    """``hf``: Hugging Face ``generate`` (works on CPU and GPU). ``static``: the model's own
    forward over a preallocated static KV cache, each decode step replayed as one CUDA graph
    on GPU (eager on CPU); not with FSDP2. ``vllm``: a colocated vLLM engine (the ``vllm``
    extra on GPU, ``vllm-cpu`` on CPU), configured by ``vllm``."""
    cuda_graphs: bool = True
    """With ``engine: static`` on GPU, replay each decode step as a CUDA graph; false runs the
    same loop eagerly."""
    compile: bool = False
    """With ``engine: static``, compile the decode step (``torch.compile``) before capturing
    it: faster steps, a compile per batch shape when a worker first meets it."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine's settings; read only when ``engine`` is ``vllm``."""
    temperature: Annotated[float, above_zero("use 0.7 to 1.2 for RL")] = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, at_least_zero("0 disables")] = 0
    """0 disables top-k filtering."""
    max_output_tokens: PositiveInt = 64
    min_output_tokens: int = 0
    mode: Literal["sync", "async"] = "sync"
    """``sync``: every training batch is sampled with the adapter being trained. ``async``:
    the member's dedicated engines (``launch.rollout_gpus_per_member``) sample ahead while the
    trainer steps, each sample tagged with the adapter version it was drawn with; see
    ``max_staleness`` and docs/rollouts.md."""
    max_staleness: Annotated[int, at_least_zero("0 trains exactly as sync; 1 to 4 is usual")] = 0
    """With ``mode: async``: the most optimizer steps a sample's adapter may lag behind the
    trainer's; older samples are dropped (counted in ``stale_dropped``), the rest corrected
    by truncated importance weights. 0 waits for samples of the current adapter."""
    staleness_cap: Annotated[float, above_zero("2.0 is usual")] = 2.0
    """Cap of the truncated importance weight ``min(p_current / p_sampler, cap)`` of a sample
    drawn with an older adapter (``mode: async``)."""
    engine_timeout_s: Seconds = 600.0
    """A dedicated engine that has not confirmed an adapter version, or returned a batch, this
    long after it was asked is a failure (a version that never arrives is not waited for)."""
    engine_heartbeat_s: Seconds = 30.0
    """A dedicated engine whose heartbeat is older than this is hung: it is stopped, named, and
    restarted once."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.mode == "sync" and self.max_staleness > 0:
            problems.append(
                f"{prefix}.max_staleness ({self.max_staleness}) needs {prefix}.mode: async "
                "(sync samples with the current adapter only); set mode: async or max_staleness: 0"
            )
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"{prefix}.top_p ({self.top_p}) must be in (0, 1]")
        if not 0 <= self.min_output_tokens <= self.max_output_tokens:
            problems.append(
                f"{prefix}.min_output_tokens ({self.min_output_tokens}) must be in "
                f"[0, max_output_tokens ({self.max_output_tokens})]"
            )
        if self.engine == "vllm":
            problems += self.vllm.check(f"{prefix}.vllm")
        else:  # unused until the engine is vllm, but its sizes are checked all the same
            problems += bound_problems(self.vllm, f"{prefix}.vllm")
        return problems


DEDICATED_ENGINES = ("hf", "static")
"""Engines a dedicated rollout process can run (vLLM is colocated, one per training process)."""


def engine_count(engines: int | str, ranks: int, mode: str) -> int:
    """A member's dedicated rollout engines: ``launch.rollout_gpus_per_member`` (a count, or
    ``"auto"``: one per trainer rank with ``rollout.mode: async``, none with sync)."""
    if engines == "auto":
        return ranks if mode == "async" else 0
    return int(engines)


def dedicated_problems(manifest) -> list[str]:
    """Dedicated engines and asynchronous rollouts against the rest of a manifest: what the
    member trains, which engine samples, and the ranks it runs on."""
    rollout, engines = manifest.rollout, manifest.launch.rollout_gpus_per_member
    if engines == "auto" and rollout.mode == "sync":
        return []  # auto without async rollouts is no engine: the trainer samples itself
    if engines == 0:
        if rollout.mode == "async":
            return [
                "rollout.mode (async) samples on dedicated engines, but "
                "launch.rollout_gpus_per_member is 0 (colocated); set it to 1"
            ]
        return []
    problems = []
    if manifest.algorithm.name not in GROUP_ALGORITHMS:
        problems.append(
            f"launch.rollout_gpus_per_member ({engines}) serves the GRPO family's rollouts, but "
            f"algorithm.name is {manifest.algorithm.name!r}; use GRPO or REINFORCE, or set it to 0"
        )
    if rollout.engine not in DEDICATED_ENGINES:
        problems.append(
            f"rollout.engine ({rollout.engine!r}) runs colocated with training; a dedicated "
            "engine (launch.rollout_gpus_per_member > 0) runs hf or static: set engine: hf"
        )
    if manifest.algorithm.dynamic_sampling:
        problems.append(
            "algorithm.dynamic_sampling (true) draws more prompts mid-step, which a dedicated "
            "engine's queue does not; set dynamic_sampling: false or rollout_gpus_per_member: 0"
        )
    if manifest.task.env is not None:
        problems.append(
            "task.env plays multi-turn episodes in the training process, which a dedicated "
            "engine (launch.rollout_gpus_per_member > 0) does not; set rollout_gpus_per_member: 0"
        )
    if manifest.distributed.fsdp:
        problems.append(
            "distributed.fsdp shards the adapter over the ranks, which a dedicated engine "
            "(launch.rollout_gpus_per_member > 0) does not gather yet; use data parallel "
            "members (fsdp: false) or rollout_gpus_per_member: 0"
        )
    ranks = manifest.launch.ranks
    if engines != "auto" and engines != ranks:
        problems.append(
            f"launch.rollout_gpus_per_member ({engines}) gives each of the member's {ranks} "
            f"ranks its own engine: set it to {ranks} (one engine per trainer rank; more are "
            "not supported yet) or auto"
        )
    return problems
