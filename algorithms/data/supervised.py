"""Data for supervised fine-tuning (SFT) and preference learning (DPO), and its tokenisation.

The rows come from ``builtin:letters`` (procedural, no download) or from the user's own data,
``task.train`` (and ``task.eval``), read by :mod:`pbt.algorithms.data.rows` like an RL task's:

- SFT: a prompt and a response per row (fields ``task.prompt_field``, ``task.response_field``)
- DPO: a prompt, a chosen and a rejected response (``prompt_field``, ``chosen_field``,
  ``rejected_field``)

``task.prompt_template`` (over any of a row's fields) makes the user turn instead of the prompt
field, and ``task.system_prompt`` adds a system turn.

``builtin:letters`` uses the prompts of the letters task and the same seeded split as
:func:`pbt.algorithms.data.tasks.load_task`, so a model fine-tuned here and then trained with RL on
``builtin:letters`` (same seed and sizes) never sees the RL eval prompts. Its responses are the
requested letter six times, space-separated (``"q q q q q q"``): the tiny model's tokenizer
splits that into the same ``q``, ``Ġq`` x5 pattern for every letter, where an unspaced run merges
into one or two letter-specific tokens. Rejected answers are a mix of other letters, which
``letters_reward`` scores below the chosen answer.

A file without ``task.eval`` is split by the campaign's seed (``eval_fraction`` held out, at
most ``eval_size`` of them measured), and training drops every row whose prompt is also held
out, so eval measures held-out prompts even when a file holds several pairs per prompt.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from pbt.algorithms.data.examples import Chat, chat_turns
from pbt.algorithms.data.fields import user_turn
from pbt.algorithms.data.tasks import LETTERS, load_task
from pbt.algorithms.rollout.hf import RolloutBatch, chat_prompts
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError

LETTERS_NAME = "builtin:letters"
RESPONSE_LETTERS = 6
"""Letters in a ``builtin:letters`` response."""


@dataclass(frozen=True, slots=True)
class SFTExample:
    """A prompt (a user turn, before chat templating) and the response to imitate."""

    prompt: str
    response: str
    system: str | None = None

    @property
    def chat(self) -> Chat:
        """What the model is prompted with."""
        return chat_turns(self.prompt, self.system)


@dataclass(frozen=True, slots=True)
class PreferenceExample:
    """A prompt with a preferred and a dispreferred response."""

    prompt: str
    chosen: str
    rejected: str
    system: str | None = None

    @property
    def chat(self) -> Chat:
        """What the model is prompted with."""
        return chat_turns(self.prompt, self.system)


T = TypeVar("T", SFTExample, PreferenceExample)


@dataclass(frozen=True, slots=True)
class Dataset(Generic[T]):
    """Disjoint train and eval splits of one dataset (``train`` may be lazy: index it)."""

    name: str
    train: Sequence[T]
    eval: Sequence[T]


def load_sft(cfg: TaskConfig, base_dir: str | Path, seed: int) -> Dataset[SFTExample]:
    """Load an SFT dataset with deterministic, disjoint train and eval splits.

    Args:
        cfg: the task section: ``builtin:letters`` (the default), or ``task.train``.
        base_dir: the folder relative paths are resolved against (the manifest's).
        seed: the campaign's ``training.seed``; fixes the split (and nothing else).

    Raises:
        ConfigError: another task name, or rows that cannot be read (see
            :func:`pbt.algorithms.data.rows.load_rows`).
    """
    if cfg.train is None:
        train, eval_ = _letters_split(cfg, seed)
        return Dataset(
            LETTERS_NAME, [_letters_sft(e) for e in train], [_letters_sft(e) for e in eval_]
        )
    return _load_rows(cfg, base_dir, seed, "SFT")


def load_preferences(
    cfg: TaskConfig, base_dir: str | Path, seed: int
) -> Dataset[PreferenceExample]:
    """Load a preference dataset with deterministic, disjoint train and eval splits.

    Arguments and errors as :func:`load_sft`.
    """
    if cfg.train is None:
        train, eval_ = _letters_split(cfg, seed)
        rng = random.Random(f"{LETTERS_NAME}:{seed}:rejected")
        return Dataset(
            LETTERS_NAME,
            [_letters_preference(e, rng) for e in train],
            [_letters_preference(e, rng) for e in eval_],
        )
    return _load_rows(cfg, base_dir, seed, "DPO")


def _letters_split(cfg: TaskConfig, seed: int):
    """The letters task's own split, so SFT/DPO and RL agree on which prompts are held out."""
    name = cfg.source
    if name != LETTERS_NAME:
        looks_like_file = "/" in name or name.endswith((".jsonl", ".json", ".csv", ".parquet"))
        fix = (
            f"your own rows go in task.train (task: {{train: {name}}})"
            if looks_like_file
            else (f"use {LETTERS_NAME}, or task.train for your own rows")
        )
        raise ConfigError([f"task.name ({name!r}) is not a dataset SFT and DPO learn from; {fix}"])
    task = load_task(
        TaskConfig(name=LETTERS_NAME, train_size=cfg.builtin_train_size, eval_size=cfg.eval_size),
        ".",
        seed,
    )
    return task.train, task.eval


def _letter_run(letter: str) -> str:
    return " ".join([letter] * RESPONSE_LETTERS)


def _letters_sft(example) -> SFTExample:
    return SFTExample(example.question, _letter_run(example.answer))


def _letters_preference(example, rng: random.Random) -> PreferenceExample:
    """Rejected: a mix of other letters (``letters_reward`` < 0.5, against 1.0 for chosen).

    Not another letter's run: telling which letter a prompt asks for is beyond the tiny
    random-weight model in a few steps (its RL run plateaus at the shape, reward 0.5), so such
    pairs would measure the model, not whether DPO works.
    """
    others = LETTERS.replace(example.answer, "")
    rejected = " ".join(rng.choices(others, k=RESPONSE_LETTERS))
    return PreferenceExample(example.question, _letter_run(example.answer), rejected)


def _load_rows(cfg: TaskConfig, base_dir: str | Path, seed: int, algorithm: str) -> Dataset:
    """The user's rows through :func:`pbt.algorithms.data.rows.load_rows`."""
    from pbt.algorithms.data.rows import load_rows

    template = user_turn(cfg, cfg.prompt_field)
    prompt, system = cfg.prompt_field, cfg.system_prompt

    def user(row: dict[str, Any]) -> str:
        made = template(row)
        return row[prompt] if made is None else made

    if algorithm == "SFT":
        response = cfg.response_field

        def convert(row: dict[str, Any]):
            return SFTExample(user(row), row[response], system)
    else:
        chosen, rejected = cfg.chosen_field, cfg.rejected_field

        def convert(row: dict[str, Any]):
            return PreferenceExample(user(row), row[chosen], row[rejected], system)

    train, eval_ = load_rows(cfg, base_dir, seed, algorithm, convert)
    return Dataset(cfg.source, train, eval_)


def encode_pairs(
    tokenizer, prompts: Sequence[Chat], responses: list[str], max_tokens: int
) -> RolloutBatch:
    """Tokenise prompts and given responses into the layout of a sampled rollout.

    The result is a :class:`~pbt.algorithms.rollout.hf.RolloutBatch`, so
    :func:`~pbt.algorithms.rollout.hf.sequence_logprobs` scores it like sampled completions.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template and a pad token.
        prompts: ``N`` user turns (or lists of turns); chat-templated by
            :func:`rollout.chat_prompts`.
        responses: ``N`` responses. Tokenised without special tokens (a literal
            ``<|im_end|>`` in the text stays text), cut to ``max_tokens - 1`` tokens and
            followed by the EOS token.
        max_tokens: the most completion tokens per row, EOS included.

    Returns:
        ``prompt_ids``/``prompt_mask`` ``[N, P]`` left-padded; ``completion_ids`` ``[N, C]``
        right-padded with the pad id, ``C <= max_tokens``; ``completion_mask`` ``[N, C]`` float,
        1.0 on the response tokens and the EOS; ``texts`` the kept response tokens, decoded.
    """
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(
            f"encode_pairs needs as many prompts ({len(prompts)}) as responses "
            f"({len(responses)}), at least one"
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1 to leave room for EOS")
    enc = tokenizer(
        chat_prompts(tokenizer, prompts),
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    )
    kept = [
        ids[: max_tokens - 1]
        for ids in tokenizer(responses, add_special_tokens=False, split_special_tokens=True)[
            "input_ids"
        ]
    ]
    width = max(len(ids) for ids in kept) + 1
    completion_ids = torch.full((len(kept), width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(len(kept), width)
    for row, ids in enumerate(kept):
        completion_ids[row, : len(ids) + 1] = torch.tensor([*ids, tokenizer.eos_token_id])
        completion_mask[row, : len(ids) + 1] = 1.0
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    return RolloutBatch(
        enc["input_ids"], enc["attention_mask"], completion_ids, completion_mask, texts
    )
