"""GRPO (Shao et al., 2024, "DeepSeekMath"): group-relative advantages and PPO's clipped ratio.

Advantages are ``(r - mean) / (std + eps)`` within each group (population std), and the per-token
loss is ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.

Where this deviates from the paper, and why:

- Groups whose rewards are all equal are masked out (``has_signal`` False) instead of
  contributing zero-advantage tokens that dilute the mean and still pull through the KL term.
- The aggregation is ``token-mean`` (DAPO's), not the paper's per-sequence mean, which favours
  long wrong answers; the caller may override it with the user's configured aggregation.
- The KL term is the caller's: ``k3`` against the adapter-disabled reference, weighted by beta.
- Numerical safety the paper does not state: masked positions are zeroed before ``exp``, the
  log-ratio is clamped to ``±20`` and, with ``dual_clip`` set, a negative-advantage token's loss
  is capped at ``dual_clip * |A|`` (see :mod:`pbt.algorithms.losses`).
"""

from __future__ import annotations

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
    """PPO's clipped surrogate per token ``([N, T] loss, [N, T] clipped)``, dual-clipped when
    ``dual_clip`` is set; masked positions get ratio 1 (aggregation drops them). Clipped tokens
    have zero gradient."""
    return losses.clipped_surrogate(
        logp, old_logp, advantages, clip_low, clip_high, mask=mask, dual_clip=dual_clip
    )
