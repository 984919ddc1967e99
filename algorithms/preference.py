"""Supervised fine-tuning and DPO losses as pure tensor functions.

DPO (Rafailov et al., 2023, "Direct Preference Optimization") with the paper's sigmoid loss,
``-log sigmoid(beta * ((pc - rc) - (pr - rr)))``, where ``pc``/``pr`` are the policy's sequence
log-probs of the chosen/rejected responses and ``rc``/``rr`` the reference model's. Here the
reference is the same model with its LoRA adapter disabled; running it (under ``no_grad``) is
the caller's job. No label smoothing, no IPO/hinge variants.

Fitness for population-based training is the preference accuracy on held-out pairs (the share
where the implicit reward ``(pc - rc)`` of the chosen beats the rejected's), not the reward
margin: the margin is multiplied by ``beta``, so after a mutation that raises ``beta`` a member
would look better without its policy changing at all. Accuracy depends only on the sign of the
log-ratio difference and is comparable across members with different ``beta``. Ties count as
wrong, so a fresh adapter (policy equal to reference) scores 0.

Shapes: ``B`` preference pairs; ``N`` sequences of ``T`` completion tokens. No
torch.distributed here: reductions across ranks belong to the caller.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def sft_loss_terms(logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Negative log-likelihood as a sum and a token count, to combine micro-batches exactly.

    Args:
        logp: ``[N, T]`` log-probs of the target tokens (with grad).
        mask: ``[N, T]`` 1.0 on tokens to learn, 0.0 on padding.

    Returns:
        ``(nll_sum, tokens)``, both scalars; the mean NLL is ``nll_sum / tokens`` after summing
        each over micro-batches (and ranks).
    """
    mask = mask.to(logp.dtype)
    return -(logp * mask).sum(), mask.sum()


def preference_accuracy(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor
) -> Tensor:
    """``[B]`` float, 1.0 where the chosen's implicit reward beats the rejected's.

    ``(pc - rc) > (pr - rr)``; independent of ``beta``. All inputs are ``[B]`` sequence
    log-prob sums.
    """
    return ((policy_chosen - ref_chosen) > (policy_rejected - ref_rejected)).float()


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO's sigmoid loss per pair.

    Args:
        policy_chosen: ``[B]`` policy log-prob sums of the chosen responses (with grad).
        policy_rejected: ``[B]`` the same for the rejected responses.
        ref_chosen: ``[B]`` reference log-prob sums of the chosen responses.
        ref_rejected: ``[B]`` the same for the rejected responses.
        beta: the inverse temperature, > 0 (higher stays closer to the reference).

    Returns:
        ``(loss [B], margin [B] detached, accuracy [B] float)`` with
        ``margin = beta * ((pc - rc) - (pr - rr))``, ``loss = -logsigmoid(margin)`` and
        ``accuracy`` as :func:`preference_accuracy`.
    """
    if not beta > 0:
        raise ValueError(f"dpo beta ({beta}) must be > 0")
    margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    loss = -F.logsigmoid(margin)
    accuracy = preference_accuracy(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return loss, margin.detach(), accuracy
