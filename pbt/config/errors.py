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
