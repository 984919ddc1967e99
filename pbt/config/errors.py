"""The small family of exceptions that reach users.

Every user-facing error says the key, the value, the rule and the fix. The CLI prints these
without a traceback and exits non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class PbtError(Exception):
    """Base class for errors caused by the user's input or environment, not by a bug."""


class ConfigError(PbtError, ValueError):
    """A manifest or ``INIT_HP`` dict broke one or more rules.

    All problems found are reported together, one per line, so a user fixes them in one pass.
    """

    def __init__(self, problems: list[str], source: str = "manifest") -> None:
        self.problems = list(problems)
        self.source = source
        count = len(self.problems)
        header = f"{source}: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([header, *(f"  - {p}" for p in self.problems)]))


class CheckpointError(PbtError):
    """A checkpoint is missing, incomplete, corrupted or incompatible; nothing was loaded."""


class DivergedError(PbtError):
    """Training diverged: the loss or gradient was non-finite (NaN or inf) for
    ``algorithm.max_nonfinite_steps`` optimizer steps in a row, each of them skipped.

    The member's task fails with fault kind ``diverged``; the campaign retries it from its
    parent's checkpoint and, after its last attempt, replaces it.
    """

    def __init__(self, steps_in_a_row: int, limit: int, step: int) -> None:
        self.steps_in_a_row, self.limit, self.step = steps_in_a_row, limit, step
        super().__init__(
            f"training diverged at step {step}: the loss or gradient was NaN or inf for "
            f"{steps_in_a_row} optimizer steps in a row (algorithm.max_nonfinite_steps = "
            f"{limit}), each one skipped; lower optim.lr, keep optim.max_grad_norm > 0 (lower "
            f"it to clip harder), set algorithm.dual_clip (e.g. 3.0) for a ratio objective, or "
            f"raise algorithm.max_nonfinite_steps to tolerate more"
        )


class RewardError(PbtError):
    """A reward function raised, ran past ``task.reward_timeout_s``, or returned something that
    is not a finite number. The message is one line naming the function, the row (question and
    an excerpt of the completion) and the value or the exception.

    ``reproduced`` says that the same input gives the same failure: a reward that raised or
    returned a bad value is called once more on the same input before this is raised (a second
    call that succeeds gives the value instead); a call that ran past its time is not tried
    again, and is not ``reproduced``. A reproduced error fails the member's task with fault kind
    ``reward_error``, which a campaign does not retry (the same member would fail the same way);
    one that is not is a plain failure, retried. ``pbt train`` prints the message and exits 2.
    """

    def __init__(self, message: str, reproduced: bool = True) -> None:
        super().__init__(message)
        self.reproduced = reproduced


class EnvError(RewardError):
    """A multi-turn environment's ``reset``, ``step`` or tool raised, ran past
    ``task.env_timeout_s``, or returned something malformed (a reward that is not a finite
    number, a step that is not a 5-tuple). One line naming the class, the turn and the action.

    It fails the member's task as a reward error does: ``reproduced`` (fault ``reward_error``,
    not retried) unless it was a timeout, which a campaign retries.
    """
