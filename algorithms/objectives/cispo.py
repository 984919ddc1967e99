"""CISPO (MiniMax, 2025, "MiniMax-M1"): clipped importance-sampling-weight policy optimisation.

The per-token loss is ``-sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp``: the
importance weight is clipped and detached, but every token keeps its policy gradient. PPO's
clipped branch instead zeroes a token's gradient, which drops rare, high-ratio "fork" tokens
exactly when they matter. Advantages are GRPO's (std-normalised); ``token-mean`` aggregation.

Where this deviates from the paper, and why:

- The paper effectively only bounds the weight from above (a very large ``clip_low``); here both
  bounds come from the caller's config, so a large ``clip_low`` recovers the paper.
- The loss *value* is ``-w * A * logp``, a surrogate whose gradient is the paper's; it is not
  comparable with PPO-style loss values.
- Groups without signal are masked; the KL term is the caller's (beta is the user's choice).
- The log-ratio is clamped to ``±20`` before ``exp``; at masked positions the weight is 1 and
  the log-prob 0, so padding adds neither value nor gradient whatever it holds (the ``clipped``
  flag alone is computed everywhere, from the clamped ratio; callers mask it). No dual clip: the weight is
  already bounded by ``1 + clip_high``, and the config refuses ``dual_clip`` for CISPO.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pbt.algorithms import losses
from pbt.algorithms.losses import Aggregation

AGGREGATION: Aggregation = "token-mean"


advantages = losses.group_advantages
"""Std-normalised group advantages ``([N], has_signal [N] bool)``, as GRPO."""


def per_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``-sg(clip(ratio)) * A * logp`` ``[N, T]``, and ``clipped`` ``[N, T]``: tokens whose
    ratio was outside the range (they still have a gradient). 0 at masked positions;
    ``dual_clip`` must be None (the weight is bounded already)."""
    if dual_clip is not None:
        raise ValueError("cispo takes no dual clip: its weight is bounded by 1 + clip_high")
    # the flag reads every position's (clamped, so finite) ratio; the loss only the real ones'
    ratio = torch.exp(losses.log_ratio(logp.detach(), old_logp))
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) != ratio
    real = mask != 0
    weight = torch.clamp(torch.where(real, ratio, 1.0), 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * losses.token_advantages(advantages) * torch.where(real, logp, 0.0)
    return loss, clipped
