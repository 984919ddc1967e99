"""LLM REINFORCE with a group baseline, and RLOO (Ahmadian et al., 2024, "Back to Basics:
Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs").

The policy gradient ``-A * logp`` per token, on-policy: no importance ratio and no clipping (one
update per batch; ``clip_low``/``clip_high``/``old_logp`` are unused and ``clipped`` is all
False). REINFORCE's baseline is the group mean, ``A = r - mean(group)``; RLOO's is the mean of
the other ``G - 1`` rewards, ``A_i = r_i - mean(others) = G / (G - 1) * (r_i - mean)``.

Where this deviates from the textbook estimator, and why:

- The estimator uses a sequence's log-prob *sum*; here the aggregation is ``sequence-mean``
  (each sequence's per-token mean, then the mean over sequences), because lengths vary and the
  gradient's scale would grow with the length.
- Groups whose rewards are all equal are masked (``has_signal`` False), as in GRPO.
- The KL term is the caller's (``k3`` against the adapter-disabled reference), not a reward
  penalty as in the paper.
- No ratio, so nothing to clamp and no dual clip (the config refuses one for REINFORCE); the
  log-prob is zeroed at masked positions, so padding holds neither value nor gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pbt.algorithms.losses import Aggregation, token_advantages
from pbt.algorithms.objectives.dr_grpo import advantages, centred_advantages

AGGREGATION: Aggregation = "sequence-mean"

__all__ = ["AGGREGATION", "advantages", "per_token_loss", "rloo_advantages"]
# advantages are Dr. GRPO's: r - mean(group), no std


def rloo_advantages(rewards: Tensor, group_size: int, eps: float) -> tuple[Tensor, Tensor]:
    """Leave-one-out ``r_i - mean(others)`` ``([N], has_signal [N] bool)``; ``eps`` is unused."""
    if group_size < 2:
        raise ValueError(
            f"rloo needs group_size >= 2 (a leave-one-out baseline), got {group_size}; "
            f"raise group_size"
        )
    centred, has_signal = centred_advantages(rewards, group_size)
    return centred * (group_size / (group_size - 1)), has_signal


def per_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``-A * logp`` ``[N, T]`` (0 at masked positions) and an all-False ``clipped``;
    ``old_logp`` and the clip arguments are unused, ``dual_clip`` must be None."""
    if dual_clip is not None:
        raise ValueError("reinforce takes no dual clip: it has no importance ratio")
    loss = -token_advantages(advantages) * torch.where(mask != 0, logp, 0.0)
    return loss, torch.zeros_like(logp, dtype=torch.bool)
