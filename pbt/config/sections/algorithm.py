"""The algorithm: which one, its loss and its hyperparameters, and which of them mutate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pbt.config.rules import (
    Count,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    above_zero,
    at_least_zero,
    bound_problems,
)

MUTABLE_HYPERPARAMETERS: dict[str, str] = {
    "lr": "optim",
    "beta": "algorithm",
    "clip_low": "algorithm",
    "clip_high": "algorithm",
    "temperature": "rollout",
    "max_grad_norm": "optim",
    "vf_coef": "algorithm",
    "value_clip": "algorithm",
    "group_size": "algorithm",
    "prompts_per_step": "algorithm",
}
"""Hyperparameters a mutation may change between generations without breaking the run, each
with the manifest section whose field of the same name holds it."""

INTEGER_HYPERPARAMETERS = frozenset({"group_size", "prompts_per_step"})
"""Mutable hyperparameters that are whole numbers: their ranges are ``int`` ranges, their values
are cast to ``int`` wherever they are set, and a mutation must keep the batch rules
(:meth:`AlgorithmConfig.batch_problems`)."""


ALGORITHMS = ("GRPO", "REINFORCE", "PPO", "SFT", "DPO")

GROUP_ALGORITHMS = ("GRPO", "REINFORCE")
"""The GRPO family: returns relative to a group of completions per prompt, no value head."""


_BATCH = ("group_size", "prompts_per_step")

MUTABLE_BY_ALGORITHM: dict[str, tuple[str, ...]] = {
    "GRPO": ("lr", "beta", "clip_low", "clip_high", "temperature", "max_grad_norm", *_BATCH),
    "REINFORCE": ("lr", "beta", "temperature", "max_grad_norm", *_BATCH),
    "PPO": (
        "lr",
        "beta",
        "clip_low",
        "clip_high",
        "temperature",
        "max_grad_norm",
        "vf_coef",
        "value_clip",
        *_BATCH,
    ),
    "SFT": ("lr", "max_grad_norm"),
    "DPO": ("lr", "beta", "max_grad_norm"),
}
"""Which hyperparameters mutate for each algorithm: the clip range means nothing to REINFORCE
(no ratio), the sampling temperature nothing to SFT and DPO (no rollouts). The algorithms that
sample groups mutate ``group_size`` and ``prompts_per_step`` too, as AgileRL tunes its group
size."""


RL_ALGORITHMS = ("GRPO", "REINFORCE", "PPO")


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
    overlong_buffer: Count = 0
    """GRPO/REINFORCE: completions within this many tokens of ``max_output_tokens`` lose reward
    linearly, down to ``-overlong_penalty`` at the limit (DAPO's soft overlong punishment);
    0 disables."""
    overlong_penalty: NonNegativeFloat = 1.0
    dynamic_sampling: bool = False
    """GRPO/REINFORCE: drop groups whose rewards are all equal and sample more prompts until
    the batch is full (DAPO), at most ``max_resamples`` extra rounds a step."""
    max_resamples: Count = 4
    group_size: int = 8
    """Completions sampled per prompt; advantages are relative within each group."""
    prompts_per_step: PositiveInt = 4
    """Prompts per training step (each repeated ``group_size`` times)."""
    beta: float = 0.0
    """KL penalty coefficient against the reference (adapter disabled); 0 skips the reference pass."""
    kl_in_advantage: bool = False
    """GRPO/REINFORCE: fold the KL penalty into each token's advantage,
    ``A_t = A + beta * (mean_t(kl) - kl_t)`` over the sequence's tokens, instead of adding
    ``beta * kl`` to the loss (ART's KL advantage shaping, AgileRL's
    ``USE_KL_ADVANTAGE_SHAPING``); the KL is detached there. No effect when ``beta`` is 0."""
    clip_low: float = 0.2
    """Lower clip: the ratio is kept above ``1 - clip_low``."""
    clip_high: float = 0.2
    """Upper clip: the ratio is kept below ``1 + clip_high``."""
    loss_aggregation: Literal["token-mean", "sequence-mean"] = "token-mean"
    """``token-mean`` averages over every token of the mini-batch; ``sequence-mean`` averages
    each sequence's tokens, then the sequences."""
    update_epochs: PositiveInt = 1
    """Passes over each rollout batch."""
    mini_batch_size: int | None = None
    """Completions per optimizer step; default: the whole rollout batch."""
    micro_batch_size: int | None = None
    """Completions per forward/backward (gradient accumulation); default: the mini-batch."""
    advantage_eps: PositiveFloat = 1e-4
    """Added to the group standard deviation before dividing."""
    advantage_norm: Literal["mean_std", "mean_only"] | None = None
    """GRPO's group advantages: ``mean_std`` ``(r - mean) / (std + eps)``, or ``mean_only``
    ``r - mean`` (AgileRL's ``ADV_NORM``); null: the objective's own, ``mean_std`` for
    ``grpo``, ``dapo``, ``cispo`` and ``gspo``. ``dr_grpo`` and REINFORCE are mean-only by
    definition and refuse ``mean_std``."""
    vf_coef: Annotated[float, at_least_zero("0.5 is usual")] = 0.5
    """PPO: weight of the value (critic) loss added to the policy loss."""
    value_clip: Annotated[float, above_zero("0.2 is usual")] = 0.2
    """PPO: new values are kept within ``value_clip`` of the values at rollout time in the
    clipped value loss."""
    gamma: float = 1.0
    """PPO: discount per completion token in GAE (1.0: no discount)."""
    lam: float = 0.95
    """PPO: GAE's lambda, trading the critic's bias (0) for the returns' variance (1)."""
    dual_clip: float | None = None
    """GRPO/PPO: cap the per-token loss of negative-advantage tokens at ``dual_clip * |A|``
    (verl's dual clip, ``clip_ratio_c``), so a token whose ratio exploded cannot dominate the
    update; must be > 1 (3.0 is usual); null disables it. Not for ``cispo`` or REINFORCE, whose
    loss has no unbounded ratio."""
    max_nonfinite_steps: Annotated[
        int, above_zero("3 is usual; a larger value tolerates more skipped steps in a row")
    ] = 3
    """Optimizer steps in a row whose loss or gradient is NaN or inf before the member fails as
    ``diverged``; each such step is skipped (no update) and counted in ``nonfinite_steps``."""
    collapse_patience: (
        Annotated[int, above_zero("or null to never end a member for lack of signal")] | None
    ) = 20
    """GRPO/REINFORCE/PPO: training steps in a row in which every group got identical rewards
    (no signal, nothing learned) before the member's task ends early as ``collapsed``, with its
    fitness measured, so selection replaces it; null never ends it."""

    @property
    def batch_completions(self) -> int:
        """Sequences per training step (derived): completions for GRPO and REINFORCE, examples
        for SFT and DPO."""
        if self.name not in RL_ALGORITHMS:
            return self.prompts_per_step
        return self.prompts_per_step * self.group_size

    def global_batch_sizes(self) -> dict[str, int]:
        """The sizes that must split evenly over a member's ranks: ``{config key: value}``."""
        mini = self.mini_batch_size or self.batch_completions
        return {"prompts_per_step": self.prompts_per_step, "mini_batch_size": mini}

    def world_problems(self, ranks: int, prefix: str = "algorithm") -> list[str]:
        """Problems splitting the global batch over ``ranks`` ranks, one per size that does not."""
        return [
            f"{prefix}.{key} ({value}) must be divisible by the member's {ranks} ranks; use a "
            f"multiple of {ranks}"
            for key, value in self.global_batch_sizes().items()
            if value % ranks
        ]

    def batch_problems(self, ranks: int, prefix: str = "algorithm") -> list[str]:
        """Every rule of this config (:meth:`check`) and of its global batch over ``ranks``
        ranks: what a mutated ``group_size`` or ``prompts_per_step`` must keep."""
        return self.check(prefix) + self.world_problems(ranks, prefix)

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
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
        problems += self._check_dual_clip(prefix)
        problems += self._check_advantage_options(prefix)
        if self.name not in RL_ALGORITHMS:
            return problems + self._check_batches(prefix)
        if self.name == "PPO":
            problems += self._check_ppo(prefix)
        elif self.group_size < 2:
            problems.append(
                f"{prefix}.group_size ({self.group_size}) must be >= 2: a group of one has no "
                "relative advantage; use 4 to 16"
            )
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
        problems += self._check_batches(prefix)
        return problems

    def _check_dual_clip(self, prefix: str) -> list[str]:
        if self.dual_clip is None:
            return []
        if self.name not in ("GRPO", "PPO") or (self.name == "GRPO" and self.loss == "cispo"):
            what = "cispo" if self.name == "GRPO" else self.name
            return [
                f"{prefix}.dual_clip ({self.dual_clip}) has no effect with {what}: its loss has "
                "no unbounded importance ratio to cap; set it to null"
            ]
        if not self.dual_clip > 1.0:
            return [
                f"{prefix}.dual_clip ({self.dual_clip}) must be > 1 (the cap dual_clip * |A| "
                "lies above the clipped branch); use 3.0, or null to disable it"
            ]
        return []

    def _check_advantage_options(self, prefix: str) -> list[str]:
        """``advantage_norm`` and ``kl_in_advantage`` act on group advantages: GRPO's and
        REINFORCE's, not PPO's (GAE over a critic) nor SFT's and DPO's (none)."""
        problems: list[str] = []
        has_groups = self.name in GROUP_ALGORITHMS
        why = {"PPO": "PPO's advantages come from its critic (GAE)"}.get(
            self.name, f"{self.name} has no advantages"
        )
        if self.advantage_norm is not None and not has_groups:
            problems.append(
                f"{prefix}.advantage_norm ({self.advantage_norm!r}) has no effect with "
                f"{self.name}: {why}; remove it"
            )
        mean_only = {"REINFORCE": "REINFORCE", "GRPO": self.loss}.get(self.name)
        if self.advantage_norm == "mean_std" and mean_only in ("REINFORCE", "dr_grpo"):
            problems.append(
                f"{prefix}.advantage_norm ('mean_std') contradicts {mean_only}, whose advantages "
                "are r - baseline without the std by definition; use algorithm.name: GRPO with "
                "loss: grpo for std-normalised advantages, or remove advantage_norm"
            )
        if self.kl_in_advantage and not has_groups:
            if self.name == "PPO":
                why = "PPO's KL is already a per-token reward (-beta * kl) in its GAE"
            problems.append(
                f"{prefix}.kl_in_advantage (true) has no effect with {self.name}: {why}; set it "
                "to false"
            )
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
