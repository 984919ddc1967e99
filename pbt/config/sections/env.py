"""A multi-turn environment for the task: ``task.env: {file, class, kwargs}``.

The environment is a class (or any callable returning one) with AgileRL's ``MultiTurnEnv``
shape; :mod:`pbt.algorithms.envs` runs it. This module states and checks the configuration
only: the file is parsed (:mod:`.source`), never run (``pbt check`` imports it and plays one
turn).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pbt.config.rules import PositiveInt, bound_problems, shown
from pbt.config.sections.source import definition_problems

BUILTIN_ENVS = ("builtin:calculator", "builtin:guess_number", "builtin:running_sum")
"""The environments shipped with the package: 4-digit arithmetic with a calculator tool, a
guess-the-number game with higher/lower feedback, and a running sum whose reward comes only at
the end."""


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """The environment the members play, its limits, and the tools offered to the model."""

    class_: str
    """The class (or factory function) in ``file`` that makes one environment; or a built-in
    environment (``builtin:calculator``, ``builtin:guess_number``, ``builtin:running_sum``)
    with no file. Written ``class`` in a manifest."""
    file: str | None = None
    """Path to a Python file, relative to the manifest's folder; null for a built-in."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class, as AgileRL's ``env_config``."""
    max_turns: PositiveInt | None = None
    """Turns (model replies) per episode at most; null takes the environment's ``max_turns``."""
    max_episode_tokens: PositiveInt = 1024
    """Tokens an episode may add after its first prompt, sampled and observed together (never
    exceeded). A turn samples at most ``min(rollout.max_output_tokens, what is left - 1)``, the
    one kept back for the EOS that closes a cut reply; an observation that leaves no room for
    another reply ends the episode as truncated (its reward counted, its tokens not appended)."""
    tools: bool = True
    """Offer the environment's tools to the model; false plays the same episodes without
    them (to measure what a tool is worth)."""

    @property
    def builtin(self) -> bool:
        """Whether ``class`` names a built-in environment."""
        return self.class_.startswith("builtin:")

    def check(self, prefix: str) -> list[str]:
        """Value rules; the file's contents are :meth:`check_source`'s."""
        problems = bound_problems(self, prefix)
        if self.builtin:
            if self.class_ not in BUILTIN_ENVS:
                problems.append(
                    f"{prefix}.class ({shown(self.class_)}) is not a built-in environment; use "
                    f"{', '.join(BUILTIN_ENVS)}, or a class in your own file"
                )
            if self.file is not None:
                problems.append(
                    f"{prefix}.file ({shown(self.file)}) is given with a built-in class "
                    f"({self.class_}); remove file, or name a class in it"
                )
            return problems
        if self.file is None:
            problems.append(
                f"{prefix}.file is required for class {shown(self.class_)}; give the .py file "
                f"that defines it, relative to the manifest's folder, or use one of "
                f"{', '.join(BUILTIN_ENVS)}"
            )
        elif "\0" in self.file or not self.file.endswith(".py"):
            problems.append(f"{prefix}.file ({shown(self.file)}) must be a .py file")
        if not self.class_.isidentifier():
            problems.append(f"{prefix}.class ({shown(self.class_)}) must be a Python identifier")
        return problems

    def check_source(self, base_dir: Path, prefix: str) -> list[str]:
        """The file exists under ``base_dir`` and defines ``class`` at its top level (parsed,
        not executed)."""
        if self.builtin or self.file is None or not self.file.endswith(".py"):
            return []
        return definition_problems(base_dir, self.file, self.class_, prefix, "class")
