"""Whether a standalone run is learning at all: ``pbt train``'s one warning, after its first
steps, when the training reward has not moved.

A new task on a model that cannot do it, a learning rate ten times too low or replies cut off
by ``rollout.max_output_tokens`` all give the same picture: a flat, near-zero reward that cannot
be told apart from a broken reward function. :class:`StallWatch` looks at the first
:data:`WATCH_STEPS` steps' metrics once and, if the reward of their second half is not above
the first half's by two standard errors, says so, with the likely causes ordered by what the
metrics show. A shorter run is not judged: a few steps of a few prompts cannot tell a flat
reward from noise. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

WATCH_STEPS = 20
"""Steps the watch waits before judging."""
TRUNCATED_SHARE = 0.9
"""A mean completion length from this share of ``max_output_tokens`` means replies are cut off."""
LOW_LR = 5e-5
"""Below this, a LoRA GRPO run is likely to move too slowly to see in its first steps: the lr
is named first."""
USUAL_LR = 1e-4
"""From this lr, a flat reward is not blamed on the lr."""
BUILTIN_MODEL = "builtin:tiny"


@dataclass(slots=True)
class StallWatch:
    """Judges, once, whether the first steps' training reward moved.

    Args:
        steps: the run's planned steps (a run shorter than :data:`WATCH_STEPS` is not judged).
        lr: ``optim.lr``, named in the warning.
        max_output_tokens: ``rollout.max_output_tokens``, against the completion lengths.
        model: ``model.name``, named when it is the built-in random-weight model.
    """

    steps: int
    lr: float
    max_output_tokens: int
    model: str
    seen: list[dict[str, float]] = field(default_factory=list)
    done: bool = False

    def observe(self, metrics: dict[str, float]) -> str | None:
        """Take one step's metrics; return the warning when this step completes the window and
        the reward has not moved (once per run), else None."""
        if self.done or "reward_mean" not in metrics or self.steps < WATCH_STEPS:
            return None
        self.seen.append(metrics)
        if len(self.seen) < WATCH_STEPS:
            return None
        self.done = True
        return self.warning(self.seen)

    def warning(self, history: Sequence[dict[str, float]]) -> str | None:
        """The warning for these steps' metrics, or None when the reward rose."""
        rewards = [m["reward_mean"] for m in history]
        half = len(rewards) // 2
        first, second = rewards[:half], rewards[half:]
        if mean(second) - mean(first) > 2 * standard_error(first, second):
            return None
        no_signal = all(m.get("zero_signal_fraction", 0.0) >= 1.0 for m in history)
        signal = (
            "no group has had signal (every group's completions got the same reward)"
            if no_signal
            else f"groups had signal in {sum(m.get('skipped', 0.0) == 0 for m in history)} steps"
        )
        return (
            f"the training reward has not moved in {len(rewards)} steps (mean {mean(first):.3f} "
            f"over steps 1-{half}, {mean(second):.3f} over steps {half + 1}-{len(rewards)}) and "
            f"{signal}. Likely causes: {'; '.join(self.causes(history, no_signal))}. See "
            "docs/own_task.md for settings that learn"
        )

    def _stronger_model(self) -> str:
        if self.model == BUILTIN_MODEL:
            return (
                f"{BUILTIN_MODEL} has random weights and knows no language; start from a "
                "pretrained instruct model (builtin:smollm2-135m-instruct or larger) that solves "
                "some prompts already"
            )
        return "start from a larger pretrained instruct model, one that solves some prompts already"

    def causes(self, history: Sequence[dict[str, float]], no_signal: bool) -> list[str]:
        """The likely causes, the one the metrics point at first."""
        length = mean([m.get("completion_length", 0.0) for m in history])
        truncated = length >= TRUNCATED_SHARE * self.max_output_tokens
        causes = {
            "tokens": (
                f"rollout.max_output_tokens ({self.max_output_tokens}) too short: completions "
                f"average {length:.1f} tokens, so replies are cut off before their answer"
                if truncated
                else f"rollout.max_output_tokens ({self.max_output_tokens}) too short for "
                f"replies longer than the {length:.1f} tokens completions average"
            ),
            "reward": (
                "the reward is always the same: try it on a few hand-written replies, give "
                "partial credit, or raise algorithm.group_size"
            ),
            "lr": (
                f"optim.lr ({self.lr:g}) too low: LoRA GRPO usually starts at 1e-4 to 5e-4 "
                "(2e-4 teaches SmolLM2-135M addition in 80 steps)"
            ),
            "model": f"a model too weak for the task: {self._stronger_model()}",
        }
        order = (
            ["reward", "model", "lr", "tokens"]
            if no_signal
            else ["lr", "model", "reward", "tokens"]
        )
        if self.lr >= USUAL_LR:
            order.remove("lr")
        first = []
        if truncated:
            first.append("tokens")
        if self.model == BUILTIN_MODEL:
            first.append("model")
        if self.lr < LOW_LR and not no_signal:
            first.append("lr")
        order = first + [key for key in order if key not in first]
        return [causes[key] for key in order]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def standard_error(first: Sequence[float], second: Sequence[float]) -> float:
    """The standard error of the difference of two means (sample variances)."""

    def var(xs: Sequence[float]) -> float:
        m = mean(xs)
        return sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)

    return math.sqrt(var(first) / max(len(first), 1) + var(second) / max(len(second), 1))
