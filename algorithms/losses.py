"""GRPO's pieces as pure tensor functions: advantages, the clipped objective, KL, aggregation.

Shapes: ``N`` completions (``prompts * group_size``, grouped contiguously), ``T`` completion
tokens. ``mask`` is 1.0 on real completion tokens, 0.0 on padding and on masked sequences.

Where this follows the GRPO paper (Shao et al., 2024) and where it does not:

- Advantages are ``(r - mean) / (std + eps)`` within each group, with the *population* standard
  deviation (divide by G, not G - 1), so a group of two with rewards 0 and 1 gets -1 and +1.
- Groups whose rewards are all equal carry no signal; instead of contributing zero-advantage
  tokens that dilute the mean (and still pull through the KL term), they are masked out
  entirely and counted, so a user can see when the task gives no signal.
- KL uses the paper's unbiased ``k3`` estimator, ``exp(ref - logp) - (ref - logp) - 1``, as a
  loss term ``beta * kl``; or, with KL advantage shaping (ART's, AgileRL's
  ``USE_KL_ADVANTAGE_SHAPING``), folded into each token's advantage instead
  (:func:`kl_shaped_advantages`).
- ``token-mean`` (DAPO-style, the default) averages over all tokens of a mini-batch;
  ``sequence-mean`` is the paper's per-sequence mean, then the mean over sequences;
  ``fixed-length`` (Dr. GRPO) divides the token sum by sequences * the generation budget, a
  constant, so a sequence's tokens weigh the same whatever its length.

Numerical safety, which the paper does not need to state (these follow verl):

- Every log-ratio is clamped to ``±LOG_RATIO_BOUND`` (20) before ``exp``: a ratio is at most
  ``e^20 ≈ 4.9e8``, finite in float32, and its product with any advantage stays finite. A clip
  range of a few tenths keeps sane ratios near 1, so the clamp binds only on a broken token (one
  whose log-prob moved by 20 nats since it was sampled); there its gradient is zero.
- The ``k3`` KL is clamped to at most ``KL_BOUND`` (10) per token, after its log-ratio was
  clamped: one token 25 nats away from the reference would otherwise weigh ``e^25 ≈ 7e10``. A
  token at the bound has no KL gradient. A policy within ~2.6 nats of the reference on every
  token (reference probability < 13x the policy's) never meets it.
- Masked positions never reach ``exp``: the log-ratio is zeroed there *before* it is
  exponentiated (``torch.where``, which also stops a NaN or inf at a padded position from
  turning into NaN through ``inf * 0``), and :func:`aggregate` selects the masked positions
  out rather than multiplying them by zero.
- Dual clip (Ye et al., 2020, "Mastering Complex Control in MOBA Games"; verl's
  ``clip_ratio_c``), off unless ``dual_clip`` is given: for a negative advantage the clipped
  surrogate grows without bound in the ratio, so the per-token loss is capped at
  ``dual_clip * |A|`` (``dual_clip > 1``); a capped token has no gradient.

On inputs where no bound binds, every function here returns exactly (bit for bit) what it would
without them.

No torch.distributed here: reductions across ranks belong to the caller.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "sequence-mean", "fixed-length"]

LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to ``[-20, 20]`` before ``exp`` (verl's bound): ``e^20 ≈ 4.9e8`` is
finite in float32 (``exp`` overflows past ~88.7) and far outside any sane clip range."""
KL_BOUND = 10.0
"""The per-token ``k3`` KL is clamped to at most 10 (verl's bound for its ``low_var_kl``)."""


def log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor | None = None) -> Tensor:
    """``logp - old_logp`` ``[N, T]``, 0 where ``mask`` is 0, clamped to ``±LOG_RATIO_BOUND``:
    safe to exponentiate whatever the masked positions hold (even NaN or inf).

    Args:
        logp: ``[N, T]`` log-probs (gradients flow through it where ``mask`` is nonzero).
        old_logp: ``[N, T]`` the log-probs to compare with.
        mask: ``[N, T]``, nonzero on real tokens; None treats every position as real.
    """
    delta = logp - old_logp
    if mask is not None:
        delta = torch.where(mask != 0, delta, torch.zeros_like(delta))
    return delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def dual_clip_loss(
    loss: Tensor, advantages: Tensor, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Cap the per-token loss of negative-advantage tokens at ``dual_clip * |A|`` (verl's
    semantics: ``where(A < 0, min(loss, -dual_clip * A), loss)``).

    Args:
        loss: ``[N, T]`` (or ``[N]``) per-token loss of a clipped surrogate.
        advantages: broadcastable onto ``loss`` (``[N, 1]`` for sequence advantages).
        dual_clip: the cap's factor, > 1; None returns ``loss`` unchanged.

    Returns:
        ``(loss, capped)``; ``capped`` marks where the cap binds (those tokens have no gradient).
    """
    if dual_clip is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip <= 1.0:
        raise ValueError(
            f"dual_clip ({dual_clip}) must be > 1: the cap dual_clip * |A| must lie above the "
            f"clipped branch's (1 - clip_low) * |A|; 3.0 is usual"
        )
    negative = (advantages < 0).expand_as(loss)
    cap = (-dual_clip * advantages).expand_as(loss)
    capped = negative & (loss > cap)
    return torch.where(capped, cap, loss), capped


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
    grouped, has_signal = reward_groups(rewards, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    advantages = torch.where(has_signal, (grouped - mean) / (std + eps), torch.zeros_like(grouped))
    return advantages.reshape(-1), has_signal.reshape(-1)


def reward_groups(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """``rewards`` ``[N]`` as groups ``[P, G]`` (float) and ``has_signal`` ``[P, G]``: False
    for every member of a group whose rewards are all equal.

    Raises:
        ValueError: ``rewards`` is not one-dimensional, or not a multiple of ``group_size``.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {tuple(rewards.shape)} is not a multiple of {group_size}"
        )
    grouped = rewards.float().view(-1, group_size)  # [P, G]
    spread = grouped.max(dim=1, keepdim=True).values - grouped.min(dim=1, keepdim=True).values
    return grouped, (spread > 0).expand_as(grouped)


def token_advantages(advantages: Tensor) -> Tensor:
    """Advantages broadcastable onto ``[N, T]``: ``[N]`` (one per sequence) as ``[N, 1]``,
    ``[N, T]`` (one per token) as they are."""
    return advantages.unsqueeze(1) if advantages.ndim == 1 else advantages


def kl_shaped_advantages(advantages: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """KL advantage shaping (ART's; AgileRL's ``USE_KL_ADVANTAGE_SHAPING``): each token's
    advantage ``A_t = A + beta * (mean_t(kl) - kl_t)``, the mean over the sequence's real tokens.

    The penalty is zero-mean within a sequence: it moves credit from the tokens that strayed
    furthest from the reference to those that stayed close, and replaces the loss term
    ``beta * kl`` (the caller adds none). The KL is detached: the shaping is a reward signal, not
    differentiated, so the gradient flows through the objective's ratio or log-prob only.

    Args:
        advantages: ``[N]`` one advantage per sequence.
        kl: ``[N, T]`` per-token KL estimate (:func:`kl_k3`).
        mask: ``[N, T]``, nonzero on real tokens; masked positions keep the sequence's advantage.
        beta: the KL coefficient; 0 returns the advantages broadcast unchanged.

    Returns:
        ``[N, T]`` per-token advantages.
    """
    real = mask != 0
    kl = torch.where(real, kl.detach(), torch.zeros_like(kl))
    mean = kl.sum(dim=1, keepdim=True) / real.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
    shift = torch.where(real, mean - kl, torch.zeros_like(kl))
    return advantages.unsqueeze(1) + beta * shift


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
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    mask: Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped objective per token, as a loss (negated), with the log-ratio clamped
    (:func:`log_ratio`) and, when ``dual_clip`` is set, negative-advantage tokens capped at
    ``dual_clip * |A|``.

    Args:
        logp: ``[N, T]`` current log-probs (with grad).
        old_logp: ``[N, T]`` log-probs of the policy that sampled the tokens.
        advantages: ``[N]`` one advantage per sequence, or ``[N, T]`` one per token.
        clip_low: the ratio's lower bound is ``1 - clip_low``.
        clip_high: the ratio's upper bound is ``1 + clip_high``.
        mask: ``[N, T]``, nonzero on real tokens; masked positions get ratio 1 (never ``exp``
            of what they hold). None: every position is real.
        dual_clip: the dual clip's factor (> 1), or None for none.

    Returns:
        ``(loss [N, T], clipped [N, T] bool)``; ``clipped`` marks tokens where a clipped branch
        (the ratio's range, or the dual clip) is the active one (its gradient is zero).
    """
    ratio = torch.exp(log_ratio(logp, old_logp, mask))
    adv = token_advantages(advantages)  # [N, 1] or [N, T]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    loss, capped = dual_clip_loss(loss, adv, dual_clip)
    return loss, (clipped < unclipped) | capped


def kl_k3(logp: Tensor, ref_logp: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token KL(policy || reference) estimate ``exp(ref - logp) - (ref - logp) - 1``
    ``[N, T]``, its log-ratio clamped to ``±LOG_RATIO_BOUND`` and the result to at most
    ``KL_BOUND``; 0 where ``mask`` (``[N, T]``, optional) is 0."""
    delta = log_ratio(ref_logp, logp, mask)
    return (torch.exp(delta) - delta - 1.0).clamp(max=KL_BOUND)


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
    ratio = torch.exp(log_ratio(trainer_logp, sampler_logp).detach())
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

    Masked positions are selected out, not multiplied by zero: whatever they hold (inf, NaN)
    reaches neither the value nor the gradient.
    """
    weighted = torch.where(mask != 0, per_token * mask, torch.zeros_like(per_token))
    if denominator <= 0:
        return weighted.sum() * 0.0
    if mode in ("token-mean", "fixed-length"):
        return weighted.sum() / denominator
    lengths = mask.sum(dim=1).clamp(min=1.0)
    return (weighted.sum(dim=1) / lengths).sum() / denominator
