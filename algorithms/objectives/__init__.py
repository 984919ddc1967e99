"""The GRPO family's objectives, one module each, and a registry by name.

An objective is two pure functions and the loss aggregation it was designed for:

- ``advantages(rewards [N], group_size, eps) -> (advantages [N], has_signal [N] bool)``;
  groups of ``group_size`` contiguous rows. ``has_signal`` is False for every member of a group
  whose rewards are all equal: the caller masks those sequences (or, with DAPO's dynamic
  sampling, drops the groups and samples more).
- ``per_token_loss(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip=None)
  -> (loss [N, T], clipped [N, T] bool)``; gradients flow through ``logp`` only. ``advantages``
  is ``[N]`` (one per sequence) or ``[N, T]`` (one per token, as KL advantage shaping makes
  them: :func:`pbt.algorithms.losses.kl_shaped_advantages`).

``get_objective(name, advantage_norm)`` picks the advantages' normalisation (AgileRL's
``ADV_NORM``): ``mean_std`` (``(r - mean) / (std + eps)``, the own normalisation of ``grpo``,
``dapo``, ``cispo`` and ``gspo``) or ``mean_only`` (``r - mean``, the only one of ``dr_grpo``,
``reinforce`` and ``rloo``, which refuse ``mean_std``: dropping the std is what defines them).

Every objective keeps masked positions out of ``exp`` (their log-ratio is zeroed first) and
clamps log-ratios to ``±losses.LOG_RATIO_BOUND``; the ratio-clipped ones (``grpo``,
``dr_grpo``, ``dapo``, ``gspo``) apply the optional dual clip (``dual_clip * |A|`` caps the loss
of negative-advantage tokens; see :mod:`pbt.algorithms.losses`). ``cispo``'s weight is bounded
by its clip range and REINFORCE has no ratio, so neither takes a dual clip (the config refuses
one for them). Garbage (huge values, inf, NaN) at masked positions changes neither the loss nor
its gradient.

The caller adds the KL term (:func:`pbt.algorithms.losses.kl_k3` against the adapter-disabled
reference, weighted by the user's ``beta``), or folds it into per-token advantages instead
(``algorithm.kl_in_advantage``), and reduces with
``losses.aggregate(loss, mask, objective.aggregation, denominator)``, the denominator from
``losses.aggregation_denominator`` over the whole mini-batch.

No torch.distributed and no transformers here.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Literal, Protocol

from torch import Tensor

from pbt.algorithms.losses import Aggregation
from pbt.algorithms.objectives import cispo, dapo, dr_grpo, grpo, gspo, reinforce

AdvantageFn = Callable[[Tensor, int, float], tuple[Tensor, Tensor]]
AdvantageNorm = Literal["mean_std", "mean_only"]


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
    """``(logp, old_logp [N, T], advantages [N] or [N, T], mask [N, T], clip_low, clip_high,
    dual_clip=None) -> (loss [N, T], clipped [N, T] bool)``."""
    advantage_norm: AdvantageNorm = "mean_std"
    """How :attr:`advantages` normalises: ``mean_std`` or ``mean_only`` (no std)."""


def _objective(
    name: str, module: ModuleType, advantages: AdvantageFn | None = None, mean_only: bool = False
) -> Objective:
    return Objective(
        name=name,
        aggregation=module.AGGREGATION,
        advantages=advantages or module.advantages,
        per_token_loss=module.per_token_loss,
        advantage_norm="mean_only" if mean_only else "mean_std",
    )


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        _objective("grpo", grpo),
        _objective("dr_grpo", dr_grpo, mean_only=True),
        _objective("dapo", dapo),
        _objective("cispo", cispo),
        _objective("gspo", gspo),
        _objective("reinforce", reinforce, mean_only=True),
        _objective("rloo", reinforce, reinforce.rloo_advantages, mean_only=True),
    )
}


def get_objective(name: str, advantage_norm: AdvantageNorm | None = None) -> Objective:
    """The objective registered as ``name``, its advantages normalised by ``advantage_norm``
    (None: the objective's own).

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names), or
            ``mean_std`` was asked of a mean-only objective.
    """
    try:
        objective = OBJECTIVES[name]
    except KeyError:
        close = difflib.get_close_matches(name, OBJECTIVES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        valid = ", ".join(sorted(OBJECTIVES))
        raise ValueError(f"unknown objective {name!r}: choose one of {valid}{hint}") from None
    if advantage_norm is None or advantage_norm == objective.advantage_norm:
        return objective
    if advantage_norm != "mean_only":
        raise ValueError(
            f"advantage_norm {advantage_norm!r} contradicts {name}, whose advantages are "
            "r - baseline without the std by definition; use grpo for mean_std"
        )
    return dataclasses.replace(objective, advantages=dr_grpo.advantages, advantage_norm="mean_only")


__all__ = ["OBJECTIVES", "AdvantageNorm", "Objective", "get_objective"]
