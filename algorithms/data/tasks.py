"""Tasks: prompts with answers, split into train and held-out eval, and their rewards.

Rows come from one of three sources, dispatched by :func:`load_task`: the user's own files
(``task.train``, read by :mod:`pbt.algorithms.data.rows`), a built-in procedural task, or a
reasoning-gym dataset (``task.name: reasoning_gym:<dataset>``).

A reward function has AgileRL's signature ``reward_fn(completion: str, answer, question) -> float``
(see :mod:`pbt.algorithms.data.rewards`, which also sums several weighted ones).
Built-in tasks are procedural (no downloads) and deterministic for a seed, one module each
under :mod:`pbt.algorithms.builtin`: ``builtin:letters``, ``builtin:arithmetic`` and
``builtin:addition`` (a fixed held-out split, and a warm-started model that learns it on a CPU).

A user reward replaces the task's own: ``task.reward: {file: rewards.py, function: my_reward}``
(or several weighted ones in ``task.rewards``), loaded only from the file the manifest names.
A reasoning-gym dataset brings its own scorer (:mod:`pbt.algorithms.data.reasoning_gym`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pbt.algorithms.builtin.addition import ADDITION_TASK, addition_split
from pbt.algorithms.builtin.arithmetic import arithmetic_problems, arithmetic_reward
from pbt.algorithms.builtin.letters import (
    LETTER_TEMPLATES,
    LETTERS,
    letters_problems,
    letters_reward,
)
from pbt.algorithms.data.examples import Example
from pbt.algorithms.data.fields import check_template, rl_example
from pbt.algorithms.data.reasoning_gym import reasoning_gym_split
from pbt.algorithms.data.rewards import (
    Reward,
    RewardFn,
    RewardTerm,
    build_reward,
    check_reward_terms,
)
from pbt.algorithms.data.stages import load_staged
from pbt.algorithms.envs.episodes import Episodes
from pbt.algorithms.envs.task import episode_seeds, episodes_for
from pbt.config import RL_ALGORITHMS, TaskConfig
from pbt.config.errors import ConfigError
from pbt.config.sections.task import REASONING_GYM_PREFIX


@dataclass(frozen=True, slots=True)
class Task:
    """A task ready to train on: disjoint train and eval splits plus the reward (None for SFT
    and DPO).

    ``train`` may be a lazy sequence over memory-mapped rows (see
    :class:`pbt.algorithms.data.rows.Rows`): index it, never copy it whole.
    """

    name: str
    train: Sequence[Example]
    eval: Sequence[Example]
    reward: Reward | Episodes | None
    """The reward of rows; a multi-turn task's environment (whose ``question`` are seeds)."""


def load_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """Build the task ``cfg`` names with deterministic, disjoint train and eval splits.

    Args:
        cfg: the task section.
        base_dir: the manifest's folder (data and reward paths are relative to it).
        seed: the campaign's ``training.seed``: the split is the same for every member.

    Raises:
        ConfigError: unknown task, too few distinct prompts, unreadable rows, or a bad reward
            reference.
    """
    if cfg.env is not None:
        train, held_out = episode_seeds(cfg, seed)
        return Task(cfg.env.class_, train, held_out, episodes_for(cfg, base_dir))
    if cfg.stages:
        return Task(cfg.source, *load_staged(cfg, base_dir, seed, load_task))
    if cfg.train is not None:
        return _file_task(cfg, base_dir, seed)
    if cfg.source.startswith(REASONING_GYM_PREFIX):
        task = _reasoning_gym_task(cfg, base_dir, seed)
    else:
        task = _builtin_task(cfg, base_dir, seed)
    if cfg.system_prompt is None and cfg.prompt_template is None and cfg.assistant_prefill is None:
        return task
    return replace(task, train=_dress(task.train, cfg), eval=_dress(task.eval, cfg))


def check_rewards(cfg: TaskConfig, base_dir: str | Path, seed: int, algorithm: str) -> list[str]:
    """``pbt check``: the user's rewards load, take ``(completion, answer, question)``, and
    score the task's first training row (its answer as the completion) with a finite number
    (:func:`pbt.algorithms.data.rewards.check_reward_terms`); one problem per reward that fails."""
    if algorithm not in RL_ALGORITHMS or not cfg.reward_refs():
        return []
    return check_reward_terms(cfg, base_dir, _sample_row(cfg, base_dir, seed))


def _sample_row(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Example | None:
    """The first training row as a member sees it; None when there is none to read (a problem
    that :func:`pbt.algorithms.data.rows.check_rows` or the member reports)."""
    try:
        if cfg.train is not None:
            from pbt.algorithms.data.rows import first_row

            row = first_row(cfg, base_dir)
            return None if row is None else rl_example(cfg)(row)
        task = load_task(replace(cfg, reward=None, rewards=[]), base_dir, seed)  # no user code
    except (ConfigError, KeyError):
        return None
    return task.train[0] if len(task.train) else None


def _file_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """The user's rows (``task.train``, ``task.eval``) with the user's reward."""
    if not cfg.reward_refs():
        raise ConfigError(
            [
                f"task.train ({cfg.train!r}) has no reward: your own rows need task.reward "
                "({file: rewards.py, function: my_reward}) or task.rewards; add one"
            ]
        )
    from pbt.algorithms.data.rows import load_rows

    train, eval_ = load_rows(cfg, base_dir, seed, "GRPO", rl_example(cfg))
    return Task(cfg.source, train, eval_, build_reward(cfg, base_dir, None))


def _reasoning_gym_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """A reasoning-gym dataset, ``task.name: reasoning_gym:<dataset>``."""
    train, held_out, own = reasoning_gym_split(cfg, seed)
    rows = [[Example(q, a) for q, a in split] for split in (train, held_out)]
    return Task(cfg.source, *rows, build_reward(cfg, base_dir, own))


def _dress(examples: Sequence[Example], cfg: TaskConfig) -> list[Example]:
    """Built-in or reasoning-gym rows with the manifest's system prompt, prompt template (over
    the fields ``question`` and ``answer``) and assistant prefill."""

    fields = ["question", "answer"]
    check_template(cfg.prompt_template, fields, f"task.name ({cfg.source!r})")
    template = cfg.prompt_template
    return [
        replace(
            ex,
            prompt=None
            if template is None
            else template.format(question=ex.question, answer=ex.answer),
            system=cfg.system_prompt,
            prefill=cfg.assistant_prefill,
        )
        for ex in examples
    ]


def _builtin_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """A built-in procedural task, seeded by ``seed``."""
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
