"""The tasks of proof of value III: procedural addition at three difficulties, split once by
hashing the question, and written as the data files a campaign reads (never the test rows).

- ``S`` (staged curriculum): ``task.stages`` moves the training rows from 2-digit to 3-digit
  to 4-digit sums at T/3 and 2T/3, each later prompt a replay of an earlier stage with
  probability :data:`REPLAY`.
- ``F`` (frontier mixture): the same problems, every difficulty mixed from the first step.
- ``control``: today's task (``builtin:addition``, 2-digit sums), where no schedule should help.

Fitness (eval) and the final figure (test) are the macro mean of exact match over the
difficulties: each difficulty contributes ``size / 3`` rows, so the plain mean over the rows is
the mean over difficulties.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

BENCH = Path(__file__).resolve().parent
DIGITS = (2, 3, 4)
"""The difficulties, in curriculum order: the number of digits of both terms."""
REPLAY = 0.2
POOL = 30_000
"""Distinct problems drawn per difficulty (2-digit sums have only 8,100)."""
TEST_BUCKETS, EVAL_BUCKETS = 25, 10
"""Of 100 hash buckets of a question: the first 25 are test rows, the next 10 eval rows, the
rest training rows. The split depends on the question alone, so it is the same on every
machine and for every seed, and no question is in two splits."""
REWARD = {"file": str(BENCH / "tasks" / "exact_integer.py"), "function": "exact_integer"}
TASKS = ("S", "F", "control")


def bucket(question: str) -> int:
    """The question's hash bucket, 0 to 99."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 100


def problems(digits: int) -> list[tuple[str, str]]:
    """Distinct ``(question, answer)`` sums of two ``digits``-digit numbers, in a fixed order."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    rng = random.Random(f"proof-v3-addition-{digits}")
    if (high - low + 1) ** 2 <= POOL:
        pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
        rng.shuffle(pairs)
    else:
        seen: set[tuple[int, int]] = set()
        pairs = []
        while len(pairs) < POOL:
            pair = (rng.randint(low, high), rng.randint(low, high))
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
    return [(f"What is {a} + {b}?", str(a + b)) for a, b in pairs]


def difficulty_splits(digits: int, eval_rows: int, test_rows: int) -> dict[str, list]:
    """One difficulty's train, eval and test rows (the first ``eval_rows`` / ``test_rows`` of its
    eval and test buckets).

    Raises:
        ValueError: the buckets hold fewer rows than asked for.
    """
    rows = problems(digits)
    test = [r for r in rows if bucket(r[0]) < TEST_BUCKETS]
    held = [r for r in rows if TEST_BUCKETS <= bucket(r[0]) < TEST_BUCKETS + EVAL_BUCKETS]
    train = [r for r in rows if bucket(r[0]) >= TEST_BUCKETS + EVAL_BUCKETS]
    if len(test) < test_rows or len(held) < eval_rows:
        raise ValueError(
            f"{digits}-digit sums hold {len(held)} eval and {len(test)} test rows, fewer than "
            f"{eval_rows} and {test_rows}; lower the eval or test size"
        )
    return {"train": train, "eval": held[:eval_rows], "test": test[:test_rows]}


def task_splits(task: str, eval_size: int, test_size: int) -> list[dict[str, list]]:
    """Each difficulty's splits (one for the control): eval and test sizes are totals, shared
    equally by the difficulties (the control's: :func:`sizes`)."""
    if task == "control":
        eval_size, test_size = sizes(task, eval_size, test_size)
        from pbt.algorithms.builtin.addition import HELD_OUT, addition_split

        train, reserve = addition_split(HELD_OUT, 10**9)
        if eval_size + test_size > HELD_OUT:
            raise ValueError(f"control: eval + test ({eval_size} + {test_size}) > {HELD_OUT}")
        return [{"train": train, "eval": reserve[:eval_size], "test": reserve[-test_size:]}]
    if task not in TASKS:
        raise ValueError(f"task ({task!r}) must be one of {', '.join(TASKS)}")
    per = len(DIGITS)
    return [difficulty_splits(d, eval_size // per, test_size // per) for d in DIGITS]


def sizes(task: str, eval_size: int, test_size: int) -> tuple[int, int]:
    """The eval and test sizes of ``task``: the control's held-out reserve of 1,024 problems
    holds at most 256 eval and the rest as test rows."""
    if task != "control":
        return eval_size, test_size
    held = min(eval_size, 256)
    return held, min(test_size, 1024 - held)


def _write(path: Path, rows: list[tuple[str, str]]) -> str:
    path.write_text("\n".join(json.dumps({"question": q, "answer": a}) for q, a in rows) + "\n")
    return str(path)


def task_section(task: str, steps: int, eval_size: int, test_size: int, folder: Path) -> dict:
    """The manifest's ``task`` section, its data files written into ``folder`` (train and eval
    rows only)."""
    if task == "control":
        held, _ = sizes(task, eval_size, test_size)
        return {"name": "builtin:addition", "eval_size": held, "train_size": 100_000}
    folder.mkdir(parents=True, exist_ok=True)
    splits = task_splits(task, eval_size, test_size)
    per = eval_size // len(DIGITS)
    if task == "F":
        mixed = [row for split in splits for row in split["train"]]
        random.Random("proof-v3-mixed").shuffle(mixed)
        held = [row for split in splits for row in split["eval"]]
        return {
            "train": _write(folder / "train.jsonl", mixed),
            "eval": _write(folder / "eval.jsonl", held),
            "eval_size": len(held),
            "reward": REWARD,
        }
    ends: list[int | None] = [*stage_ends(steps), None]
    stages = [
        {
            "until_step": end,
            "train": _write(folder / f"train{d}.jsonl", split["train"]),
            "eval": _write(folder / f"eval{d}.jsonl", split["eval"]),
        }
        for d, split, end in zip(DIGITS, splits, ends, strict=True)
    ]
    return {"stages": stages, "replay": REPLAY, "eval_size": per, "reward": REWARD}


def stage_ends(steps: int) -> list[int]:
    """The steps at which Task S's stages end (all but the last)."""
    return [steps * (i + 1) // len(DIGITS) for i in range(len(DIGITS) - 1)]
