"""The contract every in-process rollout engine keeps (``rollout.engine``: ``hf``, ``static``),
one parametrized suite on one real tiny member: rows grouped by question, completions no
longer than ``max_output_tokens`` with a mask through the first end token, texts that decode
the masked ids, greedy decoding reproducible, sampling reproducible from torch's seed, and
finite log-probs. (vLLM runs in a process of its own: tests/integration/test_vllm.py compares
it with ``generate`` token for token.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import small_manifest

from pbt.algorithms.rollout.hf import generate, sequence_logprobs
from pbt.algorithms.runtime.member import Member

CPU = torch.device("cpu")
ENGINES = ["hf", "static"]
QUESTIONS = ["Write the letter q over and over.", "hello", "a b"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def member(tmp_path_factory) -> Member:
    tmp = tmp_path_factory.mktemp("rollout-contract")
    member = Member(small_manifest(tmp, rollout={"max_output_tokens": MAX_NEW}), CPU)
    member.learner.model.eval()
    return member


def _rollout(member: Member, engine: str, **kwargs):
    learner = member.learner
    cfg = dataclasses.replace(learner.rollout_cfg, engine=engine)
    with torch.no_grad():
        return generate(learner.model, learner.tokenizer, QUESTIONS, cfg, **kwargs)


@pytest.mark.parametrize("engine", ENGINES)
def test_rows_shapes_and_masks(member, engine) -> None:
    batch = _rollout(member, engine, repeats=2)
    tokenizer = member.learner.tokenizer
    assert len(batch) == 2 * len(QUESTIONS) == len(batch.texts)
    assert batch.prompt_ids.shape == batch.prompt_mask.shape
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[1])  # repeats sit together
    assert not torch.equal(batch.prompt_ids[1], batch.prompt_ids[2])
    assert batch.completion_ids.shape == batch.completion_mask.shape
    assert batch.completion_ids.shape[1] <= MAX_NEW
    assert int(batch.completion_ids.max()) < len(tokenizer)
    for ids, mask, text in zip(
        batch.completion_ids, batch.completion_mask, batch.texts, strict=True
    ):
        kept = int(mask.sum())
        assert torch.all(mask[:kept] == 1) and torch.all(mask[kept:] == 0)  # 1s, then 0s
        ends = (ids[:kept] == tokenizer.eos_token_id).nonzero().flatten().tolist()
        assert ends in ([], [kept - 1])  # the mask stops at the first end token, inclusive
        assert text == tokenizer.decode(ids[:kept], skip_special_tokens=True)


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_is_reproducible_and_sampling_follows_the_seed(member, engine) -> None:
    first, again = _rollout(member, engine, greedy=True), _rollout(member, engine, greedy=True)
    assert torch.equal(first.completion_ids, again.completion_ids)
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        draws.append(_rollout(member, engine, temperature=1.0, repeats=2).completion_ids)
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


@pytest.mark.parametrize("engine", ENGINES)
def test_log_probs_of_the_completions_are_finite(member, engine) -> None:
    batch = _rollout(member, engine, greedy=True)
    with torch.no_grad():
        logprobs = sequence_logprobs(member.learner.model, batch, 1.0)
    assert logprobs.shape == batch.completion_ids.shape
    kept = batch.completion_mask.bool()
    assert torch.isfinite(logprobs[kept]).all() and (logprobs[kept] <= 0).all()
