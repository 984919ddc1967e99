"""Tasks: prompts with answers, split into train and held-out eval, and their rewards.

A reward function has AgileRL's signature ``reward_fn(completion: str, answer, question) -> float``.
Built-in tasks are procedural (no downloads) and deterministic for a seed:

- ``builtin:letters``: "Write the letter q over and over." Dense partial credit: half for a
  run of any one character, half for the share of the requested letter; a tiny random-weight
  model learns it on a CPU within minutes.
- ``builtin:arithmetic``: short word problems ("Tom has 3 apples and buys 5 more...") with an
  exact-answer reward on the last number of the completion; for real models.
- ``builtin:addition``: "What is 47 + 38?" with the same exact-answer reward, over a fixed
  held-out split (:mod:`pbt.algorithms.builtin.addition`); its warm-started model learns it on a CPU.

A user reward replaces the task's own: ``task.reward: {file: rewards.py, function: my_reward}``,
loaded only from the file the manifest names.
"""

from __future__ import annotations

import importlib.util
import inspect
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbt.algorithms.builtin.addition import ADDITION_TASK, addition_split
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


LETTER_TEMPLATES = (
    "Write the letter {c} over and over.",
    "Repeat the letter {c} many times.",
    "Say {c} again and again.",
    "Type the letter {c} as many times as you can.",
    "Only write {c}.",
    "Fill the line with the letter {c}.",
    "Write {c} and nothing else.",
    "Give me lots of {c}.",
)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def letters_reward(completion: str, answer: Any, question: str) -> float:
    """Partial credit for the shape, full credit for the letter, in [0, 1].

    Half the reward is the share of non-space characters taken by the most frequent one (a
    run of one letter, whatever it is); the other half is the share that is the requested
    letter (case-insensitive). ``"qqqq"`` asked for q scores 1.0, ``"aaaa"`` scores 0.5.
    """
    chars = [ch for ch in completion.lower() if not ch.isspace()]
    if not chars:
        return 0.0
    counts = Counter(chars)
    target = counts[str(answer).lower()]
    return 0.5 * (counts.most_common(1)[0][1] + target) / len(chars)


def _letters_examples() -> list[Example]:
    return [Example(t.format(c=c), c) for t in LETTER_TEMPLATES for c in LETTERS]


NAMES = ("Tom", "Ana", "Li", "Sam", "Mia", "Omar", "Eva", "Raj", "Zoe", "Ben")
ITEMS = ("apples", "books", "coins", "shells", "stamps", "marbles", "pencils", "cards")


def _arithmetic_example(rng: random.Random) -> Example:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    kind = rng.randrange(3)
    if kind == 0:
        q, ans = f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b
    elif kind == 1:
        a += b
        q, ans = f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q, ans = f"{name} has {a} bags with {b} {item} each. How many {item} in total?", a * b
    return Example(q, str(ans))


_NUMBER = re.compile(r"-?\d+")


def arithmetic_reward(completion: str, answer: Any, question: str) -> float:
    """1.0 if the last integer in the completion equals the answer, else 0.0."""
    numbers = _NUMBER.findall(completion)
    return 1.0 if numbers and int(numbers[-1]) == int(answer) else 0.0


def _arithmetic_examples(rng: random.Random, count: int) -> list[Example]:
    seen: dict[str, Example] = {}
    for _ in range(count * 20):
        ex = _arithmetic_example(rng)
        seen.setdefault(ex.question, ex)
        if len(seen) >= count:
            break
    return list(seen.values())


def load_task(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Task:
    """Build the task named in ``cfg`` with deterministic, disjoint train and eval splits.

    Raises:
        ConfigError: unknown task, too few distinct prompts, or a bad reward reference.
    """
    if cfg.name == ADDITION_TASK:
        return _addition_task(cfg, base_dir)
    rng = random.Random(f"{cfg.name}:{seed}")
    wanted = cfg.train_size + cfg.eval_size
    if cfg.name == "builtin:letters":
        pool, reward_fn = _letters_examples(), letters_reward
    elif cfg.name == "builtin:arithmetic":
        pool, reward_fn = _arithmetic_examples(rng, wanted), arithmetic_reward
    else:
        raise ConfigError(
            [
                f"task.name ({cfg.name!r}) is not a known task; use builtin:letters, "
                "builtin:arithmetic or builtin:addition"
            ]
        )
    rng.shuffle(pool)
    eval_split = pool[: cfg.eval_size]
    train_split = pool[cfg.eval_size : wanted]
    if not train_split:
        raise ConfigError(
            [
                f"task.eval_size ({cfg.eval_size}) leaves no training prompts: {cfg.name} has "
                f"{len(pool)} distinct prompts; lower eval_size"
            ]
        )
    if cfg.reward is not None:
        reward_fn = load_reward_fn(cfg.reward, base_dir)
    return Task(cfg.name, train_split, eval_split, reward_fn)


def _addition_task(cfg: TaskConfig, base_dir: str | Path) -> Task:
    """The addition task: its split is fixed whatever the seed (see :func:`addition_split`)."""
    try:
        train, held_out = addition_split(cfg.eval_size, cfg.train_size)
    except ValueError as err:
        raise ConfigError([str(err)]) from None
    reward_fn = arithmetic_reward if cfg.reward is None else load_reward_fn(cfg.reward, base_dir)
    return Task(
        cfg.name,
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
