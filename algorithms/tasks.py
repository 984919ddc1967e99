"""Tasks: prompts with answers, split into train and held-out eval, and their rewards.

A reward function has AgileRL's signature ``reward_fn(completion: str, answer, question) -> float``.
Built-in tasks are procedural (no downloads) and deterministic for a seed, one module each
under :mod:`pbt.algorithms.builtin`: ``builtin:letters``, ``builtin:arithmetic`` and
``builtin:addition`` (a fixed held-out split, and a warm-started model that learns it on a CPU).

A user reward replaces the task's own: ``task.reward: {file: rewards.py, function: my_reward}``,
loaded only from the file the manifest names.
"""

from __future__ import annotations

import importlib.util
import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbt.algorithms.builtin.addition import ADDITION_TASK, addition_split
from pbt.algorithms.builtin.arithmetic import arithmetic_problems, arithmetic_reward
from pbt.algorithms.builtin.letters import (
    LETTER_TEMPLATES,
    LETTERS,
    letters_problems,
    letters_reward,
)
from pbt.config import RewardRef, TaskConfig
from pbt.config.errors import ConfigError

RewardFn = Callable[[str, Any, str], float]


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt and the answer its reward is judged against."""

    question: str
    answer: str


@dataclass(frozen=True, slots=True)
class Task:
    """A task ready to train on: disjoint train and eval splits plus the reward."""

    name: str
    train: list[Example]
    eval: list[Example]
    reward_fn: RewardFn


def load_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """Build the task named in ``cfg`` with deterministic, disjoint train and eval splits.

    Raises:
        ConfigError: unknown task, too few distinct prompts, or a bad reward reference.
    """
    name = cfg.source
    if name == ADDITION_TASK:
        return _addition_task(cfg, base_dir)
    rng = random.Random(f"{name}:{seed}")
    wanted = cfg.builtin_train_size + cfg.eval_size
    if name == "builtin:letters":
        pool, reward_fn = [Example(q, a) for q, a in letters_problems()], letters_reward
    elif name == "builtin:arithmetic":
        problems = arithmetic_problems(rng, wanted)
        pool, reward_fn = [Example(q, a) for q, a in problems], arithmetic_reward
    else:
        raise ConfigError(
            [
                f"task.name ({name!r}) is not a known task; use builtin:letters, "
                "builtin:arithmetic or builtin:addition"
            ]
        )
    rng.shuffle(pool)
    eval_split = pool[: cfg.eval_size]
    train_split = pool[cfg.eval_size : wanted]
    if not train_split:
        raise ConfigError(
            [
                f"task.eval_size ({cfg.eval_size}) leaves no training prompts: {name} has "
                f"{len(pool)} distinct prompts; lower eval_size"
            ]
        )
    if cfg.reward is not None:
        reward_fn = load_reward_fn(cfg.reward, base_dir)
    return Task(name, train_split, eval_split, reward_fn)


def _addition_task(cfg: TaskConfig, base_dir: str | Path) -> Task:
    """The addition task: its split is fixed whatever the seed (see :func:`addition_split`)."""
    try:
        train, held_out = addition_split(cfg.eval_size, cfg.builtin_train_size)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    reward_fn = arithmetic_reward if cfg.reward is None else load_reward_fn(cfg.reward, base_dir)
    return Task(
        ADDITION_TASK,
        [Example(q, a) for q, a in train],
        [Example(q, a) for q, a in held_out],
        reward_fn,
    )


def load_reward_fn(ref: RewardRef, base_dir: str | Path) -> RewardFn:
    """Import ``ref.function`` from ``ref.file`` (relative to ``base_dir``) and check its signature.

    Raises:
        ConfigError: missing file, import failure, missing or non-callable function, or a
            function that cannot take ``(completion, answer, question)``.
    """
    path = (Path(base_dir) / ref.file).resolve()
    if not path.is_file():
        raise ConfigError([f"task.reward.file ({ref.file!r}) not found at {path}; check the path"])
    spec = importlib.util.spec_from_file_location(f"pbt_user_reward_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ConfigError([f"task.reward.file ({ref.file!r}) failed to import: {err!r}"]) from None
    fn = getattr(module, ref.function, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(
            [
                f"task.reward.function ({ref.function!r}) is not a function in {ref.file}; found: {names}"
            ]
        )
    try:
        inspect.signature(fn).bind("completion", "answer", "question")
    except TypeError:
        raise ConfigError(
            [
                f"task.reward.function ({ref.function!r}) must accept (completion, answer, "
                f"question); its signature is {inspect.signature(fn)}"
            ]
        ) from None
    return fn


__all__ = [
    "LETTERS",
    "LETTER_TEMPLATES",
    "Example",
    "RewardFn",
    "Task",
    "arithmetic_reward",
    "letters_reward",
    "load_reward_fn",
    "load_task",
]
