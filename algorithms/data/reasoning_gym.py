"""reasoning-gym tasks: ``task.name: reasoning_gym:<dataset>`` (the ``tasks`` extra).

Rows come from the dataset's own generator: ``train_size + eval_size`` entries (2048 training
rows when ``train_size`` is null), seeded by ``training.seed``, with ``task.options`` as the
dataset's config. The first ``eval_size`` entries are held out for fitness; the training rows
are the rest, less any whose question is also held out, so the splits are disjoint.

The reward is the dataset's own scorer, ``dataset.score_answer(answer, entry)``, given the
whole entry (question, answer, metadata) as the row's ``answer``: a user reward in
``task.reward`` gets that entry too. The answer a completion gives is the text of its last
``<answer>...</answer>`` tag when it has one, else its last non-empty line, stripped.

reasoning-gym is imported only here, and only when such a task is loaded (it takes a second).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

from pbt.algorithms.data.rewards import RewardTerm
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError
from pbt.config.sections.task import REASONING_GYM_PREFIX

INSTALL = "pip install 'pbt-llm[tasks]'"
RESERVED_OPTIONS = {"size": "train_size and eval_size", "seed": "training.seed"}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)

Rows = list[tuple[str, dict[str, Any]]]


def extract_answer(completion: str) -> str:
    """The answer a completion gives: the text inside its last ``<answer>...</answer>`` tag,
    else its last non-empty line; stripped ("" for an empty completion)."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Scorer:
    """A dataset's own scorer as a reward: ``scorer(completion, entry, question) -> float``.

    Args:
        dataset: the reasoning-gym dataset whose ``score_answer`` judges the answer.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, completion: str, answer: dict[str, Any], question: str) -> float:
        return self.dataset.score_answer(extract_answer(completion), answer)


def reasoning_gym_split(cfg: TaskConfig, seed: int) -> tuple[Rows, Rows, RewardTerm]:
    """Training and held-out rows ``(question, entry)`` of ``reasoning_gym:<dataset>``, and
    the dataset's scorer as the task's own reward.

    Raises:
        ConfigError: reasoning-gym is not installed, the dataset is unknown, or
            ``task.options`` does not fit its config.
    """
    name = cfg.source.removeprefix(REASONING_GYM_PREFIX)
    dataset = _create(name, cfg, cfg.builtin_train_size + cfg.eval_size, seed)
    entries = [dataset[i] for i in range(len(dataset))]
    held_out = [(e["question"], e) for e in entries[: cfg.eval_size]]
    seen = {q for q, _ in held_out}
    train = [(e["question"], e) for e in entries[cfg.eval_size :] if e["question"] not in seen]
    if not train:
        raise ConfigError(
            [
                f"task.name ({cfg.source!r}) gave no training rows apart from the "
                f"{cfg.eval_size} held out; raise task.train_size or lower task.eval_size"
            ]
        )
    term = RewardTerm(name, cfg.source, Scorer(dataset))
    return train, held_out, term


def _create(name: str, cfg: TaskConfig, size: int, seed: int) -> Any:
    """``reasoning_gym.create_dataset(name, size=, seed=, **options)``, every failure a
    one-line :class:`ConfigError`."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(
            [f"task.name ({cfg.source!r}) needs the reasoning-gym package; {INSTALL}"]
        ) from None
    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(REASONING_GYM_PREFIX + c for c in close)}?"
            if close
            else (f"it has {len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:5])}")
        )
        raise ConfigError([f"task.name ({cfg.source!r}) is not a reasoning-gym dataset; {hint}"])
    for key, owner in RESERVED_OPTIONS.items():
        if key in cfg.options:
            raise ConfigError(
                [f"task.options.{key} ({cfg.options[key]!r}) is set by {owner}; remove it"]
            )
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **cfg.options)
    except (TypeError, ValueError, AssertionError, KeyError) as err:
        config = DATASETS[name][1]
        known = [f.name for f in dataclasses.fields(config) if f.name not in RESERVED_OPTIONS]
        raise ConfigError(
            [
                f"task.options ({cfg.options!r}) do not fit {cfg.source}: "
                f"{' '.join(str(err).split()) or type(err).__name__}; its options are "
                f"{', '.join(known)}"
            ]
        ) from None
