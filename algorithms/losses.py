"""GRPO's pieces as pure tensor functions: advantages, the clipped objective, KL, aggregation.

Shapes: ``N`` completions (``prompts * group_size``, grouped contiguously), ``T`` completion
tokens. ``mask`` is 1.0 on real completion tokens, 0.0 on padding and on masked sequences.

Where this follows the GRPO paper (Shao et al., 2024) and where it does not:

- Advantages are ``(r - mean) / (std + eps)`` within each group, with the *population* standard
  deviation (divide by G, not G - 1), so a group of two with rewards 0 and 1 gets -1 and +1.
- Groups whose rewards are all equal carry no signal; instead of contributing zero-advantage
  tokens that dilute the mean (and still pull through the KL term), they are masked out
  entirely and counted, so a user can see when the task gives no signal.
- KL uses the paper's unbiased ``k3`` estimator, ``exp(ref - logp) - (ref - logp) - 1``.
- ``token-mean`` (DAPO-style, the default) averages over all tokens of a mini-batch;
  ``sequence-mean`` is the paper's per-sequence mean, then the mean over sequences;
  ``fixed-length`` (Dr. GRPO) divides the token sum by sequences * the generation budget, a
  constant, so a sequence's tokens weigh the same whatever its length.

No torch.distributed here: reductions across ranks belong to the caller.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "sequence-mean", "fixed-length"]


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-4) -> tuple[Tensor, Tensor]:
    """Group-relative advantages.

    Args:
        rewards: ``[N]`` rewards, groups of ``group_size`` contiguous.
        group_size: completions per prompt.
        eps: added to the standard deviation.

    Returns:
        ``(advantages [N], has_signal [N] bool)``; ``has_signal`` is False for every member of
        a group whose rewards are all equal (their advantages are 0).
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} is not a multiple of {group_size}"
        )
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    spread = grouped.max(dim=1, keepdim=True).values - grouped.min(dim=1, keepdim=True).values
    has_signal = (spread > 0).expand_as(grouped)
    advantages = torch.where(has_signal, (grouped - mean) / (std + eps), torch.zeros_like(grouped))
    return advantages.reshape(-1), has_signal.reshape(-1)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Args:
        logits: ``[N, T, V]`` (any float dtype; computed in float32).
        targets: ``[N, T]`` token ids.

    Returns:
        ``[N, T]`` float32 log-probabilities.
    """
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped objective per token, as a loss (negated).

    Args:
        logp: ``[N, T]`` current log-probs (with grad).
        old_logp: ``[N, T]`` log-probs of the policy that sampled the tokens.
        advantages: ``[N]`` one advantage per sequence.
        clip_low: the ratio's lower bound is ``1 - clip_low``.
        clip_high: the ratio's upper bound is ``1 + clip_high``.

    Returns:
        ``(loss [N, T], clipped [N, T] bool)``; ``clipped`` marks tokens where the clipped branch
        is the active one (its gradient is zero).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(1)  # [N, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    return loss, clipped < unclipped


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimate ``exp(ref - logp) - (ref - logp) - 1`` ``[N, T]``."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def truncated_importance_weights(
    trainer_logp: Tensor, sampler_logp: Tensor, cap: float
) -> tuple[Tensor, Tensor]:
    """Per-token weights ``min(p_trainer / p_sampler, cap)`` (no gradient) that correct a loss
    for tokens sampled by an engine whose log-probs differ slightly from the trainer's (truncated
    importance sampling, as in Yao et al., 2025), and where the cap bit.

    Args:
        trainer_logp: ``[N, T]`` the trainer's log-probs of the tokens at rollout time.
        sampler_logp: ``[N, T]`` the sampling engine's log-probs of the same tokens.
        cap: the truncation, > 0.
    """
    ratio = torch.exp((trainer_logp - sampler_logp).detach())
    return ratio.clamp(max=cap), ratio > cap


def aggregation_denominator(
    mask: Tensor, mode: Aggregation, max_tokens: int | None = None
) -> float:
    """What a whole mini-batch's loss is divided by: its tokens, its sequences, or its
    sequences times the generation budget (``fixed-length``).

    Computed once per mini-batch so that micro-batches with gradient accumulation give exactly
    the loss of the mini-batch in one piece. Sequences are those with at least one real token,
    so masked (zero-signal) sequences do not dilute the loss.

    Args:
        mask: ``[N, T]`` 1.0 on real completion tokens.
        mode: the aggregation.
        max_tokens: the generation budget; required by ``fixed-length``, ignored otherwise.
    """
    if mode == "token-mean":
        return float(mask.sum())
    sequences = float((mask.sum(dim=1) > 0).sum())
    if mode != "fixed-length":
        return sequences
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(
            f"aggregation 'fixed-length' needs max_tokens > 0 (the generation budget), got "
            f"{max_tokens}; pass max_tokens=<max output tokens>"
        )
    return sequences * max_tokens


def aggregate(per_token: Tensor, mask: Tensor, mode: Aggregation, denominator: float) -> Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar.

    ``token-mean``: ``sum(loss * mask) / denominator`` (denominator = tokens in the mini-batch).
    ``sequence-mean``: each sequence's masked mean, summed, ``/ denominator`` (= sequences).
    ``fixed-length``: ``sum(loss * mask) / denominator`` (= sequences * generation budget).
    """
    if denominator <= 0:
        return per_token.sum() * 0.0
    if mode in ("token-mean", "fixed-length"):
        return (per_token * mask).sum() / denominator
    lengths = mask.sum(dim=1).clamp(min=1.0)
    return ((per_token * mask).sum(dim=1) / lengths).sum() / denominator
