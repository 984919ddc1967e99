"""The proof of value's two tasks: their fixed, disjoint train / eval / test splits, the data
files a campaign reads (never the test rows), the manifest's task section, and the
warm-started models (``bench/proof_of_value.py``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proof_of_value import Shape

TASKS = ("addition", "chain_sum")
BENCH = Path(__file__).resolve().parent

CHAIN_SUM = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}
"""reasoning-gym ``chain_sum`` options of the second task."""
CHAIN_SUM_SEED = 20261202


CHAIN_SUM_FILE = BENCH / "tasks" / "chain_sum.jsonl"
"""The pool, written once by :func:`generate_chain_sum_rows` (so a machine without
reasoning-gym runs the task too); a test checks it against the generator."""


def generate_chain_sum_rows() -> list[tuple[str, str]]:
    """Every distinct ``chain_sum`` problem that reasoning-gym generates from a fixed seed, in a
    fixed shuffled order: the pool the three splits are cut from."""
    import reasoning_gym

    data = reasoning_gym.create_dataset("chain_sum", size=40_000, seed=CHAIN_SUM_SEED, **CHAIN_SUM)
    rows = {}
    for entry in data:
        rows.setdefault(entry["question"], str(entry["answer"]))
    pairs = sorted(rows.items())
    random.Random(CHAIN_SUM_SEED).shuffle(pairs)
    return pairs


def chain_sum_rows() -> list[tuple[str, str]]:
    """The pool of :func:`generate_chain_sum_rows`, read from :data:`CHAIN_SUM_FILE`."""
    lines = CHAIN_SUM_FILE.read_text().splitlines()
    return [(row["question"], row["answer"]) for row in map(json.loads, lines)]


def task_splits(task: str, shape: Shape) -> dict[str, list[tuple[str, str]]]:
    """The task's ``train``, ``eval`` and ``test`` rows as (question, answer), disjoint. The eval
    split selects (fitness); the test split is never seen by a campaign.

    Raises:
        ValueError: an unknown task, or splits larger than the task's held-out reserve.
    """
    if task == "addition":
        from pbt.algorithms.builtin.addition import HELD_OUT, addition_split

        if shape.eval_size + shape.test_size > HELD_OUT:
            raise ValueError(
                f"eval_size + test_size ({shape.eval_size} + {shape.test_size}) must be <= "
                f"{HELD_OUT}, the held-out reserve of builtin:addition; lower test_size"
            )
        train, reserve = addition_split(HELD_OUT, 10**9)
        return {
            "train": train,
            "eval": reserve[: shape.eval_size],
            "test": reserve[HELD_OUT - shape.test_size :],
        }
    if task == "chain_sum":
        rows = chain_sum_rows()
        held = 1024
        if shape.eval_size + shape.test_size > held:
            raise ValueError(
                f"eval_size + test_size ({shape.eval_size} + {shape.test_size}) must be <= "
                f"{held}, the held-out reserve of chain_sum; lower test_size"
            )
        return {
            "train": rows[held:],
            "eval": rows[: shape.eval_size],
            "test": rows[held - shape.test_size : held],
        }
    raise ValueError(f"task ({task!r}) must be one of {', '.join(TASKS)}")


def write_task_files(task: str, shape: Shape, folder: Path) -> Path:
    """The data-file task's train and eval rows as JSONL in ``folder`` (the test rows are
    not written: no campaign can read them). Returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    splits = task_splits(task, shape)
    for name in ("train", "eval"):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in splits[name]]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def task_section(task: str, shape: Shape, data: Path) -> dict:
    """The manifest's ``task`` section."""
    if task == "addition":
        return {"name": "builtin:addition", "eval_size": shape.eval_size, "train_size": 100_000}
    return {
        "train": str(data / "train.jsonl"),
        "eval": str(data / "eval.jsonl"),
        "eval_size": shape.eval_size,
        "reward": {"file": str(BENCH / "tasks" / "exact_integer.py"), "function": "exact_integer"},
    }


def warm_model(task: str, shape: Shape) -> str:
    """The warm-started model's folder for ``task`` and ``shape`` (built once, cached)."""
    from pbt.algorithms.builtin.addition import WarmStart, warm_model_dir

    recipe = WarmStart(model=shape.warm_model, steps=shape.warm_steps[task])
    start = time.perf_counter()
    if task == "addition":
        folder = warm_model_dir(recipe, seed=0)
    else:
        folder = _warm_on_rows(task, recipe, task_splits(task, shape)["train"])
    print(f"{task}: warm-started model {folder} ({time.perf_counter() - start:.0f} s)", flush=True)
    return str(folder)


def _warm_on_rows(task: str, recipe, train: list[tuple[str, str]]) -> Path:
    """:mod:`pbt.algorithms.builtin.addition`'s warm start on other training rows, cached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pbt.algorithms.builtin.addition import MARKER, _supervised
    from pbt.algorithms.builtin.tiny import build_shaped_model

    cache = Path(os.environ.get("PBT_CACHE_DIR") or Path.home() / ".cache" / "pbt-llm")
    folder = cache / f"proof-{task}-{recipe.key()}"
    if (folder / MARKER).is_file():
        return folder
    tmp = cache / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_shaped_model(tmp, seed=0, **recipe.model)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    torch.manual_seed(0)
    _supervised(model, tokenizer, train, recipe, random.Random(0))
    model.save_pretrained(tmp)
    (tmp / MARKER).write_text(f"{task} warm start\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder
