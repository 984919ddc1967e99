"""``builtin:addition``: two-number addition with an exact-answer reward, and a warm-started
model that half knows it.

Problems are ``"What is 47 + 38?"`` with the sum as the answer, both operands in ``0 .. 99``.
The split into held-out and training problems is fixed (it does not depend on a run's seed),
so the warm start never sees a held-out problem whatever seed a campaign uses.

The warm-started model is the built-in tiny model's tokenizer and architecture (or another
shape), trained from random weights by full-parameter supervised fine-tuning on the training
problems for a deliberately short time: it writes a number for every question and gets a part
of them right. RL with the exact-answer reward then has real signal to climb. Built once per
(shape, seed) into an ordinary Hugging Face folder and cached; deterministic for its seed on
the CPU.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pbt.algorithms.builtin.tiny import build_shaped_model
from pbt.protocol.files import COMPLETE, build_once

logger = logging.getLogger(__name__)

ADDITION_TASK = "builtin:addition"
WARM_VERSION = 2
"""Bump when the warm-start recipe changes; part of the cache folder name."""
MARKER = COMPLETE
SPLIT_SEED = "builtin:addition split"
HELD_OUT = 1024
"""Problems reserved for evaluation (of the 10,000 two-digit pairs)."""


@dataclass(frozen=True, slots=True)
class WarmStart:
    """How the warm-started model is built: its shape and its supervised training."""

    model: dict[str, object] = field(default_factory=dict)
    """Qwen2 config fields over the tiny model's (empty: the tiny model's shape)."""
    steps: int = 600
    """Supervised steps; few enough that the model stays well short of its ceiling."""
    batch_size: int = 64
    lr: float = 1e-3

    def key(self) -> str:
        """A short, stable name for the cache folder."""
        import hashlib
        import json

        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:10]


def question(a: int, b: int) -> str:
    """The prompt of one problem."""
    return f"What is {a} + {b}?"


def addition_split(
    eval_size: int, train_size: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Fixed, disjoint (train, eval) lists of ``(question, answer)`` pairs.

    Every ordered pair of operands is one problem; they are shuffled once with a fixed seed.
    The first :data:`HELD_OUT` are reserved for evaluation whatever ``eval_size`` (so the warm
    start never trains on them), and the first ``eval_size`` of those are the eval split;
    ``train_size`` caps the training split.

    Raises:
        ValueError: ``eval_size`` is larger than the reserve.
    """
    if not 0 <= eval_size <= HELD_OUT:
        raise ValueError(
            f"task.eval_size ({eval_size}) must be in [0, {HELD_OUT}] for {ADDITION_TASK}: the "
            "held-out reserve is fixed; lower eval_size"
        )
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    problems = [(question(a, b), str(a + b)) for a, b in pairs]
    return problems[HELD_OUT : HELD_OUT + train_size], problems[:eval_size]


# -- the warm-started model ----------------------------------------------------------------


def warm_model_dir(recipe: WarmStart, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """The folder of the warm-started model for ``recipe`` and ``seed``, built once if missing.

    Safe across processes: one builds it, the others wait and then find it
    (:func:`~pbt.protocol.files.build_once`).
    """
    if cache_dir is None:
        cache_dir = os.environ.get("PBT_CACHE_DIR") or Path.home() / ".cache" / "pbt-llm"
    root = Path(cache_dir).expanduser()
    folder = root / f"addition-warm-v{WARM_VERSION}-{recipe.key()}-s{seed}"
    return build_once(folder, lambda tmp: build_warm_model(tmp, recipe, seed))


def build_warm_model(out_dir: str | Path, recipe: WarmStart, seed: int = 0) -> None:
    """Build a random-weight model of ``recipe.model``'s shape into ``out_dir``, train it on the
    training problems for ``recipe.steps`` steps, and save it (marker last).

    The global torch RNG state is restored afterwards.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    out = Path(out_dir)
    build_shaped_model(out, seed=seed, **recipe.model)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        train, _ = addition_split(eval_size=0, train_size=10**9)
        loss = _supervised(model, tokenizer, train, recipe, random.Random(seed))
    finally:
        torch.random.set_rng_state(rng_state)
    model.save_pretrained(out)
    (out / MARKER).write_text(f"{ADDITION_TASK} warm start v{WARM_VERSION} seed {seed}\n")
    logger.info("warm-started %s in %.1fs (last loss %.3f)", out, time.perf_counter() - start, loss)


def _supervised(model, tokenizer, train, recipe: WarmStart, rng: random.Random) -> float:
    """Full-parameter next-token training on the answers (and the end-of-turn token)."""
    import torch

    from pbt.algorithms.rollout.hf import chat_prompts

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    device = next(model.parameters()).device
    model.train()
    loss = torch.zeros(())
    for _ in range(recipe.steps):
        batch = rng.sample(train, recipe.batch_size)
        ids, labels = _encode(tokenizer, chat_prompts(tokenizer, [q for q, _ in batch]), batch)
        ids, labels = ids.to(device), labels.to(device)
        # right padding under a causal mask: the padding only follows the answers
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def _encode(tokenizer, prompts: list[str], batch: list[tuple[str, str]]):
    """Right-padded ids ``[B, T]`` and labels ``[B, T]`` (-100 outside the answers)."""
    import torch

    rows, targets = [], []
    for prompt, (_, answer) in zip(prompts, batch, strict=True):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append(p + a)
        targets.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
    return ids, labels
