"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization").

The importance ratio and its clipping are per sequence, not per token:
``s_i = exp(mean over the sequence's tokens of (logp - old_logp))`` (the length-normalised
sequence likelihood ratio), and the loss of sequence ``i`` is
``-min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)``. Advantages are GRPO's
(std-normalised). The per-sequence loss is returned broadcast onto the sequence's tokens, so
``sequence-mean`` aggregation gives exactly the mean of the per-sequence losses and its gradient;
any other aggregation would weight a sequence by its length.

The paper's clip ranges are far smaller than PPO's (e.g. 3e-4 and 4e-4), since a sequence-level
ratio moves much less than a token's; the caller's config decides.

Where this deviates from the paper: groups without signal are masked; the KL term is the
caller's (``k3`` against the adapter-disabled reference, beta the user's choice). Each token's
log-ratio is zeroed at masked positions and clamped to ``±20`` before the sequence mean (so the
sequence's log-ratio is within ``±20`` before ``exp``), and the optional dual clip caps a
negative-advantage sequence's loss at ``dual_clip * |A|``, as verl's token-level dual clip does
for a token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pbt.algorithms import losses
from pbt.algorithms.losses import Aggregation

AGGREGATION: Aggregation = "sequence-mean"


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
    """Each sequence's clipped loss broadcast onto its tokens ``[N, T]``, and ``clipped``
    ``[N, T]``: True on every token of a sequence whose clipped branch is active. With per-token
    advantages ``[N, T]`` (KL shaping) the sequence's ratio weighs each token's advantage."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
    log_ratio = (losses.log_ratio(logp, old_logp, mask) * mask).sum(dim=1, keepdim=True) / lengths
    ratio = torch.exp(log_ratio)  # [N, 1]
    adv = losses.token_advantages(advantages)  # [N, 1] or [N, T]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss, capped = losses.dual_clip_loss(-torch.minimum(unclipped, clipped), adv, dual_clip)
    shape = logp.shape
    return loss.expand(shape), ((clipped < unclipped) | capped).expand(shape)
