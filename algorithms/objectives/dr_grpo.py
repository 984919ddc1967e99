"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective").

GRPO with its two biases removed: advantages are ``r - mean(group)`` (no division by the std,
which over-weights groups that are nearly all right or all wrong), and the loss is not
normalised by each sequence's length: ``fixed-length`` aggregation divides the token sum by
``sequences * max_tokens``, the generation budget (a constant), so every token weighs the same
and a long wrong answer is penalised as much per token as a short one. The per-token loss is
PPO's clipped surrogate, as in GRPO.

Where this deviates from the paper, and why:

- Groups whose rewards are all equal are masked out (``has_signal`` False) rather than
  contributing zero-advantage tokens; with a constant denominator those would only scale the
  loss down (and still pull through the KL term).
- The KL term is the caller's (``k3`` against the adapter-disabled reference); the paper trains
  without it, here beta is the user's choice.
- Masked positions are zeroed before ``exp``, the log-ratio is clamped to ``±20`` and the
  optional dual clip caps a negative-advantage token's loss at ``dual_clip * |A|``, as GRPO.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pbt.algorithms.losses import Aggregation, reward_groups
from pbt.algorithms.objectives.grpo import per_token_loss

AGGREGATION: Aggregation = "fixed-length"

__all__ = ["AGGREGATION", "advantages", "centred_advantages", "per_token_loss"]
# per_token_loss is GRPO's: PPO's clipped surrogate, dual-clipped when dual_clip is set


def centred_advantages(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """``r - mean(group)`` without the std, zero where the group has no signal.

    Args:
        rewards: ``[N]`` rewards, groups of ``group_size`` contiguous.
        group_size: completions per prompt.

    Returns:
        ``(advantages [N], has_signal [N] bool)``.
    """
    grouped, has_signal = reward_groups(rewards, group_size)  # [P, G] each
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = torch.where(has_signal, centred, torch.zeros_like(grouped))
    return advantages.reshape(-1), has_signal.reshape(-1)


def advantages(rewards: Tensor, group_size: int, eps: float) -> tuple[Tensor, Tensor]:
    """``r - mean(group)`` ``([N], has_signal [N] bool)``; ``eps`` is unused (no std)."""
    return centred_advantages(rewards, group_size)
