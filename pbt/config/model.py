"""The base model, its LoRA adapter and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pbt.config.rules import positive

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


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
        positive(problems, f"{prefix}.r", self.r, "use a rank such as 8 or 16")
        positive(problems, f"{prefix}.alpha", self.alpha)
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
        positive(problems, f"{prefix}.lr", self.lr, "a LoRA run typically uses 1e-5 to 1e-3")
        if self.weight_decay < 0:
            problems.append(f"{prefix}.weight_decay ({self.weight_decay}) must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            problems.append(f"{prefix}.betas ({self.betas}) must be two values in [0, 1)")
        positive(problems, f"{prefix}.eps", self.eps)
        if self.max_grad_norm < 0:
            problems.append(
                f"{prefix}.max_grad_norm ({self.max_grad_norm}) must be >= 0 (0 disables)"
            )
        if self.warmup_steps < 0:
            problems.append(f"{prefix}.warmup_steps ({self.warmup_steps}) must be >= 0")
        return problems
