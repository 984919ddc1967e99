"""Zero signal and policy collapse: what a member's step metrics say about them, in figures and
in words. No torch here: the member's log, the controller and library mode say the same thing.

A GRPO-family step learns nothing from a group whose completions all got the same reward (no
group-relative advantage). When every group of a step is so, the step is *zero-signal*: its
update is skipped (``skipped`` is 1). Two different troubles look alike from the rewards:

- the task gives no spread: the reward is too coarse, the group too small, or sampling too
  cold for completions to differ;
- *policy collapse*: the policy puts all its mass on one completion, so every sample of a group
  is the same text (``identical_group_fraction`` near 1); most often a learning rate too high.

A member whose steps are zero-signal ``algorithm.collapse_patience`` times in a row ends its
task early as ``collapsed``: it is evaluated and saved, its result says so, and selection
replaces it (:data:`COLLAPSED`).
"""

from __future__ import annotations

from collections.abc import Sequence

COLLAPSED = "collapsed"
"""The kind of a member that ended its task early for lack of signal: in its result
(``result["fault"]["kind"]``, the result's status still ``ok``: it has a checkpoint and a
fitness), its record (``MemberRecord.collapsed``) and the campaign's fault log."""

ZERO_SIGNAL_HINT = (
    "every group in this batch got identical rewards, so there is nothing to learn from and the "
    "update was skipped. Likely causes: the reward is too coarse (all 0 or all 1; give partial "
    "credit), group_size is too small to see different outcomes (try 8 or 16), or the "
    "temperature is too low for completions to differ (try 0.8 to 1.2)."
)

COLLAPSE_HINT = (
    "every group in this batch got identical rewards and {share} of the groups sampled the very "
    "same completion every time: policy collapse, the policy has put all its probability on one "
    "answer and no longer explores. The learning rate is most likely too high (lower optim.lr, "
    "e.g. by 10x, or keep optim.max_grad_norm > 0); a rollout.temperature well below 1 makes "
    "it worse."
)

COLLAPSE_SHARE = 0.5
"""From this fraction of groups with identical completions, a zero-signal step is called policy
collapse rather than a reward without spread."""


def diagnosis(metrics: dict[str, float]) -> str:
    """Why a zero-signal step learned nothing and what to change, from its metrics
    (``identical_group_fraction`` tells policy collapse apart)."""
    share = float(metrics.get("identical_group_fraction", 0.0))
    if share >= COLLAPSE_SHARE:
        return COLLAPSE_HINT.format(share="all" if share >= 1.0 else f"{share:.0%}")
    return ZERO_SIGNAL_HINT


def is_zero_signal(metrics: dict[str, float]) -> bool:
    """Whether a step's update was skipped because no group had signal."""
    return bool(metrics.get("skipped", 0.0))


def last_zero_signal(history: Sequence[dict[str, float]]) -> dict[str, float] | None:
    """The last zero-signal step's metrics in ``history``, or None."""
    return next((m for m in reversed(history) if is_zero_signal(m)), None)


def signal_note(figures: dict[str, float]) -> str:
    """``", zero-signal 0.42 (last 1.00)"`` for a progress line, or nothing without figures."""
    if "zero_signal_fraction_mean" not in figures:
        return ""
    mean, last = figures["zero_signal_fraction_mean"], figures["zero_signal_fraction"]
    return f", zero-signal {mean:.2f} (last {last:.2f})"


def signal_summary(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Figures of a task's steps for its result, status line and tracking: the zero-signal
    fraction (mean over the steps and the last step's), how many steps were wholly zero-signal,
    and the last step's fraction of groups with identical completions. Empty for algorithms
    without groups (no ``zero_signal_fraction`` in their metrics)."""
    fractions = [m["zero_signal_fraction"] for m in history if "zero_signal_fraction" in m]
    if not fractions:
        return {}
    summary = {
        "zero_signal_fraction": float(fractions[-1]),
        "zero_signal_fraction_mean": sum(fractions) / len(fractions),
        "zero_signal_steps": float(sum(is_zero_signal(m) for m in history)),
    }
    if "identical_group_fraction" in history[-1]:
        summary["identical_group_fraction"] = float(history[-1]["identical_group_fraction"])
    return summary


def collapse_detail(steps_in_a_row: int, patience: int, step: int) -> str:
    """The words for a member ended as collapsed at lineage step ``step`` (what follows is the
    caller's to say: in a campaign and in library mode, selection replaces it)."""
    return (
        f"no signal for {steps_in_a_row} steps in a row (algorithm.collapse_patience = "
        f"{patience}) up to step {step}: training stops here, and the member is evaluated and "
        "saved as it is"
    )
