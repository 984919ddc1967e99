"""A member's run: steps, evaluation, device, and how its ranks share the work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pbt.config.rules import Count, NonNegativeFloat, PositiveInt, Seconds, bound_problems
from pbt.config.sections.fsdp import fsdp_problems

Device = Literal["auto", "cpu", "cuda"]


@dataclass(kw_only=True, slots=True)
class DistributedConfig:
    """How a member's ranks share the work."""

    fsdp: bool | dict[str, object] | None = None
    """``True`` for default FSDP2 sharding, a dict of ``FSDPConfig`` fields, or None for data
    parallel (each rank holds the whole model)."""
    timeout_s: Seconds = 600.0
    """A collective waiting longer than this (a peer rank died or hung) fails the member with
    an error instead of hanging it."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.fsdp is None or isinstance(self.fsdp, bool):
            return problems
        return problems + fsdp_problems(self.fsdp, f"{prefix}.fsdp")


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The member's run: how long, how often to evaluate, where to write."""

    steps: PositiveInt = 100
    """Training steps (one rollout batch each)."""
    eval_every: Count = 0
    """Evaluate on the held-out split every N steps; 0 evaluates only before and after."""
    eval_temperature: NonNegativeFloat = 0.0
    """Sampling temperature for evaluation; 0 is greedy."""
    seed: Count = 0
    output_dir: str = "runs/member"
    """Where the checkpoint and logs go, relative to the working directory."""
    device: Device = "auto"
    """``auto`` picks CUDA when available, else CPU."""
    log_every: PositiveInt = 1
    mixed_precision: bool = True
    """On CUDA with a bf16 or fp16 base: the trainer's forward passes run under autocast, so the
    adapter's float32 master weights are cast once per pass and every matmul runs in the half
    type. No effect on CPU or a float32 base, nor under FSDP2 (its policy does the same)."""
    compile: bool = False
    """Compile the decoder (forward and backward) with ``torch.compile``: faster steps after a
    compile of a minute or so at start; not with FSDP2."""
    activation_checkpointing: bool = False
    """Keep only each transformer block's input from the training forward and recompute the
    block in the backward pass: activation memory drops from every layer's intermediates to
    one hidden state per layer (plus one block's, briefly), for about a third more compute per
    step. Applied per block before FSDP2 shards it; rollouts and evaluation (no gradients)
    never recompute anything."""
    activation_offloading: bool = False
    """On CUDA: move the tensors the training forward saves for backward to pinned host memory
    as they are saved, on a side stream that overlaps the copies with compute, and bring them
    back (prefetched) in the backward pass. GPU activation memory drops to about two layers'
    worth at the price of host memory and PCIe traffic; with ``activation_checkpointing`` only
    the blocks' inputs travel. No effect on the CPU, where the activations already live."""

    def check(self, prefix: str) -> list[str]:
        return bound_problems(self, prefix)
