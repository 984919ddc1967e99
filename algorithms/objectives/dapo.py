"""DAPO (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

GRPO's std-normalised advantages and clipped surrogate with DAPO's changes:

- Clip-higher: an asymmetric range ``[1 - clip_low, 1 + clip_high]`` (the paper uses 0.2 and
  0.28) so low-probability tokens can grow; the values come from the caller's config.
- Token-level normalisation (``token-mean``): every token of the mini-batch weighs the same.
- Overlong reward shaping: :func:`overlong_penalty`, added to the rewards by the caller.
- Dynamic sampling (drop groups whose rewards are all equal, sample more prompts until the batch
  is full) is the learner's job; the objective only provides ``has_signal`` for it.

Where this deviates from the paper: the paper drops the KL term; here the caller adds it (``k3``
against the adapter-disabled reference) and beta is the user's choice, 0 recovering the paper.
Groups without signal that reach the loss are masked, as in GRPO; the log-ratio clamp, the
masking before ``exp`` and the optional dual clip are GRPO's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pbt.algorithms import losses
from pbt.algorithms.losses import Aggregation
from pbt.algorithms.objectives.grpo import per_token_loss

AGGREGATION: Aggregation = "token-mean"


advantages = losses.group_advantages
"""Std-normalised group advantages ``([N], has_signal [N] bool)``, as GRPO."""


__all__ = ["AGGREGATION", "advantages", "overlong_penalty", "per_token_loss"]
# per_token_loss is GRPO's: PPO's clipped surrogate with the (asymmetric) range the config gives


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, a reward term ``[N]``.

    0 up to ``max_tokens - buffer`` tokens, then linear down to ``-factor`` at ``max_tokens``
    (and ``-factor`` beyond): ``-factor * (length - (max_tokens - buffer)) / buffer`` clipped to
    ``[-factor, 0]``.

    Args:
        lengths: ``[N]`` completion lengths in tokens.
        max_tokens: the generation budget.
        buffer: tokens before the budget where the penalty ramps up; ``0 < buffer <= max_tokens``.
        factor: the penalty at the budget, ``>= 0``.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(
            f"overlong buffer ({buffer}) must be in (0, max_tokens={max_tokens}]; "
            f"lower the buffer or raise the generation budget"
        )
    if factor < 0:
        raise ValueError(f"overlong penalty factor ({factor}) must be >= 0")
    excess = (lengths.float() - (max_tokens - buffer)) / buffer
    return -factor * torch.clamp(excess, 0.0, 1.0)
