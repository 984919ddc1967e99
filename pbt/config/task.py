"""The task: prompts with answers, and the reward."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from pbt.config.rules import positive

RL_TASKS = ("builtin:letters", "builtin:arithmetic", "builtin:addition")
"""The prompt sets an RL algorithm learns from (each with its own reward)."""
"""Algorithms that sample completions and learn from rewards (the rest learn from datasets)."""


@dataclass(kw_only=True, slots=True)
class RewardRef:
    """A user reward function ``reward_fn(completion, answer, question) -> float`` in a file."""

    file: str
    """Path to a Python file, relative to the manifest's folder."""
    function: str
    """Name of the function in that file."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        if "\0" in self.file:
            problems.append(
                f"{prefix}.file ({self.file!r}) holds a NUL byte, which no path may; give a .py "
                "path relative to the manifest's folder"
            )
        elif not self.file.endswith(".py"):
            problems.append(f"{prefix}.file ({self.file!r}) must be a .py file")
        if not self.function.isidentifier():
            problems.append(f"{prefix}.function ({self.function!r}) must be a Python identifier")
        return problems

    def check_source(self, base_dir: Path, prefix: str) -> list[str]:
        """The file exists under ``base_dir`` and defines ``function`` at its top level. The
        source is parsed, not executed: a manifest check runs no user code."""
        path = base_dir / self.file
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except OSError as err:
            return [
                f"{prefix}.file ({self.file!r}) cannot be read ({path}: {err.strerror}); give a "
                ".py path relative to the manifest's folder"
            ]
        except SyntaxError as err:
            return [
                f"{prefix}.file ({self.file!r}) is not valid Python: line {err.lineno}: "
                f"{err.msg}; fix the file"
            ]
        defined = [
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        ] + [
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        ]
        if self.function not in defined:
            found = ", ".join(defined) or "nothing"
            return [
                f"{prefix}.function ({self.function!r}) is not defined at the top level of "
                f"{self.file}; it defines: {found}"
            ]
        return []


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """The prompts, their answers and the reward."""

    name: str = "builtin:letters"
    """A built-in procedural task (``builtin:letters``, ``builtin:arithmetic``,
    ``builtin:addition``)."""
    reward: RewardRef | None = None
    """Replace the task's own reward with a user function."""
    train_size: int = 2048
    """Prompts in the training split (at most; a small built-in task may have fewer)."""
    eval_size: int = 64
    """Prompts in the held-out evaluation split (disjoint from training)."""

    def check(self, prefix: str) -> list[str]:
        problems: list[str] = []
        positive(problems, f"{prefix}.train_size", self.train_size)
        positive(problems, f"{prefix}.eval_size", self.eval_size)
        if self.reward is not None:
            problems += self.reward.check(f"{prefix}.reward")
        return problems
