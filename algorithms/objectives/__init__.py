"""The GRPO family's objectives, one module each, and a registry by name.

An objective is two pure functions and the loss aggregation it was designed for:

- ``advantages(rewards [N], group_size, eps) -> (advantages [N], has_signal [N] bool)``;
  groups of ``group_size`` contiguous rows. ``has_signal`` is False for every member of a group
  whose rewards are all equal: the caller masks those sequences (or, with DAPO's dynamic
  sampling, drops the groups and samples more).
- ``per_token_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip=None)
  -> (loss [N, T], clipped [N, T] bool)``; gradients flow through ``logp`` only.

Every objective keeps masked positions out of ``exp`` (their log-ratio is zeroed first) and
clamps log-ratios to ``±losses.LOG_RATIO_BOUND``; the ratio-clipped ones (``grpo``,
``dr_grpo``, ``dapo``, ``gspo``) apply the optional dual clip (``dual_clip * |A|`` caps the loss
of negative-advantage tokens; see :mod:`pbt.algorithms.losses`). ``cispo``'s weight is bounded
by its clip range and REINFORCE has no ratio, so neither takes a dual clip (the config refuses
one for them). Garbage (huge values, inf, NaN) at masked positions changes neither the loss nor
its gradient.

The caller adds the KL term (:func:`pbt.algorithms.losses.kl_k3` against the adapter-disabled
reference, weighted by the user's ``beta``) and reduces with
``losses.aggregate(loss, mask, objective.aggregation, denominator)``, the denominator from
``losses.aggregation_denominator`` over the whole mini-batch.

No torch.distributed and no transformers here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from torch import Tensor

from pbt.algorithms.losses import Aggregation
from pbt.algorithms.objectives import cispo, dapo, dr_grpo, grpo, gspo, reinforce

AdvantageFn = Callable[[Tensor, int, float], tuple[Tensor, Tensor]]


class LossFn(Protocol):
    """``(logp, old_logp [N, T], advantages [N], mask [N, T], clip_low, clip_high,
    dual_clip=None) -> (loss [N, T], clipped [N, T] bool)``."""

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        clip_low: float,
        clip_high: float,
        dual_clip: float | None = None,
    ) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Objective:
    """One policy-gradient objective of the GRPO family."""

    name: str
    """The registry key, e.g. ``"dr_grpo"``."""
    aggregation: Aggregation
    """The loss aggregation the objective is defined with."""
    advantages: AdvantageFn
    """``(rewards [N], group_size, eps) -> (advantages [N], has_signal [N] bool)``."""
    per_token_loss: LossFn
    """``(logp, old_logp [N, T], advantages [N], mask [N, T], clip_low, clip_high,
    dual_clip=None) -> (loss [N, T], clipped [N, T] bool)``."""


def _objective(name: str, module: ModuleType, advantages: AdvantageFn | None = None) -> Objective:
    return Objective(
        name=name,
        aggregation=module.AGGREGATION,
        advantages=advantages or module.advantages,
        per_token_loss=module.per_token_loss,
    )


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        _objective("grpo", grpo),
        _objective("dr_grpo", dr_grpo),
        _objective("dapo", dapo),
        _objective("cispo", cispo),
        _objective("gspo", gspo),
        _objective("reinforce", reinforce),
        _objective("rloo", reinforce, reinforce.rloo_advantages),
    )
}


def get_objective(name: str) -> Objective:
    """The objective registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered; the message lists the valid names.
    """
    try:
        return OBJECTIVES[name]
    except KeyError:
        close = difflib.get_close_matches(name, OBJECTIVES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        valid = ", ".join(sorted(OBJECTIVES))
        raise ValueError(f"unknown objective {name!r}: choose one of {valid}{hint}") from None


__all__ = ["OBJECTIVES", "Objective", "get_objective"]
