"""Tasks: prompts with answers, split into train and held-out eval, and their rewards.

A reward function has AgileRL's signature ``reward_fn(completion: str, answer, question) -> float``
(see :mod:`pbt.algorithms.rewards`). Built-in tasks are procedural (no downloads) and deterministic
for a seed, one module each under :mod:`pbt.algorithms.builtin`: ``builtin:letters``,
``builtin:arithmetic`` and ``builtin:addition`` (a fixed held-out split, and a warm-started model
that learns it on a CPU).

A user reward replaces the task's own: ``task.reward: {file: rewards.py, function: my_reward}``
(or several weighted ones in ``task.rewards``), loaded only from the file the manifest names.
``reasoning_gym:<dataset>`` names a dataset of reasoning-gym (:mod:`pbt.algorithms.reasoning_gym`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from pbt.algorithms.builtin.addition import ADDITION_TASK, addition_split
from pbt.algorithms.builtin.arithmetic import arithmetic_problems, arithmetic_reward
from pbt.algorithms.builtin.letters import (
    LETTER_TEMPLATES,
    LETTERS,
    letters_problems,
    letters_reward,
)
from pbt.algorithms.reasoning_gym import reasoning_gym_split
from pbt.algorithms.rewards import Reward, RewardFn, RewardTerm, build_reward
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError
from pbt.config.task import REASONING_GYM_PREFIX


@dataclass(frozen=True, slots=True)
class Example:
    """One prompt and the answer its reward is judged against."""

    question: str
    answer: str


@dataclass(frozen=True, slots=True)
class Task:
    """A task ready to train on: disjoint train and eval splits plus the reward (None for SFT
    and DPO)."""

    name: str
    train: list[Example]
    eval: list[Example]
    reward: Reward | None


def load_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """Build the task named in ``cfg`` with deterministic, disjoint train and eval splits.

    Raises:
        ConfigError: unknown task, too few distinct prompts, or a bad reward reference.
    """
    name = cfg.source
    if name.startswith(REASONING_GYM_PREFIX):
        train, held_out, own = reasoning_gym_split(cfg, seed)
        rows = [[Example(q, a) for q, a in split] for split in (train, held_out)]
        return Task(name, *rows, build_reward(cfg, base_dir, own))
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
    reward = build_reward(cfg, base_dir, RewardTerm(name.split(":")[-1], name, reward_fn))
    return Task(name, train_split, eval_split, reward)


def _addition_task(cfg: TaskConfig, base_dir: str | Path) -> Task:
    """The addition task: its split is fixed whatever the seed (see :func:`addition_split`)."""
    try:
        train, held_out = addition_split(cfg.eval_size, cfg.builtin_train_size)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    own = RewardTerm("addition", ADDITION_TASK, arithmetic_reward)
    return Task(
        ADDITION_TASK,
        [Example(q, a) for q, a in train],
        [Example(q, a) for q, a in held_out],
        build_reward(cfg, base_dir, own),
    )


__all__ = [
    "LETTERS",
    "LETTER_TEMPLATES",
    "Example",
    "RewardFn",
    "Task",
    "arithmetic_reward",
    "letters_reward",
    "load_task",
]
