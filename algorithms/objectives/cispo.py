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
) -> tuple[Tensor, Tensor]:
    """``-sg(clip(ratio)) * A * logp`` ``[N, T]``, and ``clipped`` ``[N, T]``: tokens whose
    ratio was outside the range (they still have a gradient). ``mask`` is unused."""
    ratio = torch.exp(logp.detach() - old_logp)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages.unsqueeze(1) * logp
    return loss, weight != ratio
