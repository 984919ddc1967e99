"""Data for supervised fine-tuning (SFT) and preference learning (DPO), and its tokenisation.

A dataset is named like a task: ``builtin:letters`` (procedural, no download) or the path of a
local JSONL file, relative to the manifest's folder, one object per line:

- SFT: ``{"prompt": "...", "response": "..."}``
- DPO: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``

``builtin:letters`` uses the prompts of the letters task and the same seeded split as
:func:`pbt.algorithms.tasks.load_task`, so a model fine-tuned here and then trained with RL on
``builtin:letters`` (same seed and sizes) never sees the RL eval prompts. Its responses are the
requested letter six times, space-separated (``"q q q q q q"``): the tiny model's tokenizer
splits that into the same ``q``, ``Ġq`` x5 pattern for every letter, where an unspaced run merges
into one or two letter-specific tokens. Rejected answers are a mix of other letters, which
``letters_reward`` scores below the chosen answer.

A JSONL file is split by seed: ``eval_size`` examples are held out and training takes the rest
(at most ``train_size``), minus any example whose prompt is also in eval, so eval measures
held-out prompts even when a file holds several pairs per prompt.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Generic, TypeVar

import torch

from pbt.algorithms.rollout.hf import RolloutBatch, chat_prompts
from pbt.algorithms.tasks import LETTERS, load_task
from pbt.config import TaskConfig
from pbt.config.errors import ConfigError

LETTERS_NAME = "builtin:letters"
RESPONSE_LETTERS = 6
"""Letters in a ``builtin:letters`` response."""
MAX_LINE_PROBLEMS = 5
"""Bad lines of a JSONL file reported in one error; the rest are counted."""


@dataclass(frozen=True, slots=True)
class SFTExample:
    """A prompt (a user turn, before chat templating) and the response to imitate."""

    prompt: str
    response: str


@dataclass(frozen=True, slots=True)
class PreferenceExample:
    """A prompt with a preferred and a dispreferred response."""

    prompt: str
    chosen: str
    rejected: str


T = TypeVar("T", SFTExample, PreferenceExample)


@dataclass(frozen=True, slots=True)
class Dataset(Generic[T]):
    """Disjoint train and eval splits of one dataset."""

    name: str
    train: list[T]
    eval: list[T]


def load_sft(
    name: str, base_dir: str | Path, seed: int, train_size: int, eval_size: int
) -> Dataset[SFTExample]:
    """Load an SFT dataset with deterministic, disjoint train and eval splits.

    Args:
        name: ``builtin:letters`` or a JSONL path relative to ``base_dir``.
        base_dir: the folder relative paths are resolved against (the manifest's).
        seed: fixes the split (and nothing else).
        train_size: at most this many training examples.
        eval_size: exactly this many eval examples.

    Raises:
        ConfigError: unknown built-in, or a missing, unreadable, malformed or too small file.
    """
    if name == LETTERS_NAME:
        train, eval_ = _letters_split(seed, train_size, eval_size)
        return Dataset(name, [_letters_sft(e) for e in train], [_letters_sft(e) for e in eval_])
    return _load_jsonl(name, base_dir, seed, train_size, eval_size, SFTExample)


def load_preferences(
    name: str, base_dir: str | Path, seed: int, train_size: int, eval_size: int
) -> Dataset[PreferenceExample]:
    """Load a preference dataset with deterministic, disjoint train and eval splits.

    Arguments and errors as :func:`load_sft`.
    """
    if name == LETTERS_NAME:
        train, eval_ = _letters_split(seed, train_size, eval_size)
        rng = random.Random(f"{name}:{seed}:rejected")
        return Dataset(
            name,
            [_letters_preference(e, rng) for e in train],
            [_letters_preference(e, rng) for e in eval_],
        )
    return _load_jsonl(name, base_dir, seed, train_size, eval_size, PreferenceExample)


def _letters_split(seed: int, train_size: int, eval_size: int):
    """The letters task's own split, so SFT/DPO and RL agree on which prompts are held out."""
    task = load_task(
        TaskConfig(name=LETTERS_NAME, train_size=train_size, eval_size=eval_size), ".", seed
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


def _load_jsonl(
    name: str, base_dir: str | Path, seed: int, train_size: int, eval_size: int, kind: type[T]
) -> Dataset[T]:
    if name.startswith("builtin:"):
        raise ConfigError(
            [
                f"task.name ({name!r}) is not a built-in dataset; use {LETTERS_NAME} or the "
                "path of a .jsonl file"
            ]
        )
    path = (Path(base_dir) / name).resolve()
    examples = _parse_jsonl(name, path, kind)
    rng = random.Random(f"{name}:{seed}")
    rng.shuffle(examples)
    eval_ = examples[:eval_size]
    held_out = {e.prompt for e in eval_}
    train = [e for e in examples[eval_size:] if e.prompt not in held_out][:train_size]
    if len(eval_) < eval_size or not train:
        raise ConfigError(
            [
                f"task.eval_size ({eval_size}) leaves no training examples: task.name "
                f"({name!r}) holds {len(examples)} examples in {path} ({len(held_out)} distinct "
                "prompts held out for eval, with every example that shares one); lower "
                "eval_size or add examples"
            ]
        )
    return Dataset(name, train, eval_)


def _parse_jsonl(name: str, path: Path, kind: type[T]) -> list[T]:
    """Every example of the file, in order; all bad lines reported together."""
    where = f"task.name ({name!r})"
    if not path.is_file():
        raise ConfigError([f"{where} is not a file: nothing at {path}; check the path"])
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            [f"{where}: {path} could not be read ({err}); make it a readable UTF-8 file"]
        ) from None
    keys = [f.name for f in fields(kind)]
    examples: list[T] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record, problem = _parse_line(line, keys, kind)
        if problem is None:
            examples.append(record)
        else:
            problems.append(f"{where}: line {number} of {path} {problem}")
    if problems:
        extra = len(problems) - MAX_LINE_PROBLEMS
        more = [f"... and {extra} more bad lines in {path}"] if extra > 0 else []
        raise ConfigError(problems[:MAX_LINE_PROBLEMS] + more)
    if not examples:
        raise ConfigError(
            [f"{where}: {path} holds no examples; write one JSON object per line: {_shape(keys)}"]
        )
    return examples


def _parse_line(line: str, keys: list[str], kind: type[T]) -> tuple[T | None, str | None]:
    """``(example, None)`` for a good line, else ``(None, what is wrong and the fix)``."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return None, f"is not valid JSON ({err.msg} at column {err.colno}); fix the line"
    if not isinstance(record, dict):
        return None, f"is a JSON {type(record).__name__}, not an object; write {_shape(keys)}"
    missing = [k for k in keys if k not in record]
    extra = sorted(set(record) - set(keys))
    if missing or extra:
        wrong = [f"missing {missing}"] * bool(missing) + [f"unknown {extra}"] * bool(extra)
        return None, f"has the wrong keys ({'; '.join(wrong)}); each line must be {_shape(keys)}"
    not_str = [k for k in keys if not isinstance(record[k], str)]
    if not_str:
        return None, f"has non-string values for {not_str}; quote them as JSON strings"
    if kind is PreferenceExample and record["chosen"] == record["rejected"]:
        return None, "has identical chosen and rejected; drop the pair (it states no preference)"
    return kind(**record), None


def _shape(keys: list[str]) -> str:
    return "{" + ", ".join(f'"{k}": "..."' for k in keys) + "}"


def encode_pairs(
    tokenizer, prompts: list[str], responses: list[str], max_tokens: int
) -> RolloutBatch:
    """Tokenise prompts and given responses into the layout of a sampled rollout.

    The result is a :class:`~pbt.algorithms.rollout.RolloutBatch`, so
    :func:`~pbt.algorithms.rollout.sequence_logprobs` scores it like sampled completions.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template and a pad token.
        prompts: ``N`` user turns; chat-templated by :func:`rollout.chat_prompts`.
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
