"""The static-cache rollout (``rollout.engine: static``) against Hugging Face ``generate``.

On CPU the decode step runs eagerly: the same code a CUDA graph captures on GPU, so what these
tests check (tokens, masks, sampling, positions) is what the graph replays.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import small_manifest

from pbt.algorithms.rollout.hf import generate, sequence_logprobs
from pbt.algorithms.rollout.static import Sampling, pick_tokens
from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError

CPU = torch.device("cpu")
QUESTIONS = [
    "Write the letter q over and over.",
    "hello",
    "Tom has 3 apples and buys 5 more. How many apples does Tom have now?",
    "a b",
]


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("static")
    member = Member(small_manifest(tmp, rollout={"max_output_tokens": 20}), CPU)
    member.learner.model.eval()
    return member


def _randomise(member, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in member.learner.named_params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _both(member, **kwargs):
    learner = member.learner
    cfg = learner.rollout_cfg
    static = dataclasses.replace(cfg, engine="static")
    hf = generate(learner.model, learner.tokenizer, QUESTIONS, cfg, **kwargs)
    ours = generate(learner.model, learner.tokenizer, QUESTIONS, static, **kwargs)
    return hf, ours


def _same_completions(a, b) -> None:
    width = max(a.completion_ids.shape[1], b.completion_ids.shape[1])

    def padded(t, value):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    assert torch.equal(padded(a.completion_mask, 0.0), padded(b.completion_mask, 0.0))
    pad = 0
    assert torch.equal(
        padded(a.completion_ids.masked_fill(a.completion_mask == 0, pad), pad),
        padded(b.completion_ids.masked_fill(b.completion_mask == 0, pad), pad),
    )
    assert a.texts == b.texts


@pytest.mark.parametrize("adapter", ["base", "random LoRA"])
def test_greedy_tokens_equal_generate(member, adapter):
    """Greedy completions (prompts of different lengths, left-padded) equal ``generate``'s
    token for token, with the base model and with an adapter that changes the output."""
    if adapter == "base":
        with torch.no_grad():
            for _, p in member.learner.named_params:
                p.zero_()
    else:
        _randomise(member, 1)
    hf, ours = _both(member, greedy=True)
    _same_completions(hf, ours)
    assert len({t for t in hf.texts}) > 1


def test_min_output_tokens_holds_back_the_end_token(member):
    """With ``min_output_tokens`` the end-of-sequence token is suppressed for as many tokens as
    ``generate`` suppresses it, and the completions still agree."""
    _randomise(member, 2)
    learner = member.learner
    cfg = dataclasses.replace(learner.rollout_cfg, min_output_tokens=8)
    hf = generate(learner.model, learner.tokenizer, QUESTIONS, cfg, greedy=True)
    ours = generate(
        learner.model,
        learner.tokenizer,
        QUESTIONS,
        dataclasses.replace(cfg, engine="static"),
        greedy=True,
    )
    _same_completions(hf, ours)
    assert (ours.completion_mask.sum(dim=1) >= 8).all()


def test_sampled_completions_are_scored_by_the_trainer(member):
    """Sampled rows: every real token has a finite log-prob under the trainer, the mask ends at
    the first end-of-sequence token, padding follows it, and the torch seed fixes the draw."""
    _randomise(member, 3)
    learner = member.learner
    cfg = dataclasses.replace(learner.rollout_cfg, engine="static")
    torch.manual_seed(7)
    a = generate(learner.model, learner.tokenizer, QUESTIONS, cfg, repeats=4)
    torch.manual_seed(7)
    b = generate(learner.model, learner.tokenizer, QUESTIONS, cfg, repeats=4)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert len(set(a.texts)) > 4  # sampled, not greedy
    eos, pad = learner.tokenizer.eos_token_id, learner.tokenizer.pad_token_id
    for row, mask in zip(a.completion_ids, a.completion_mask, strict=True):
        real = int(mask.sum())
        assert (row[real:] == pad).all()
        assert eos not in row[: real - 1].tolist()
    with torch.no_grad():
        logp = sequence_logprobs(learner.model, a, cfg.temperature)
    assert torch.isfinite(logp[a.completion_mask > 0]).all()


def test_sampling_draws_from_the_tempered_distribution():
    """20,000 draws per row match ``softmax(logits / T)`` (largest frequency error < 0.015)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 2
    temperature = torch.tensor([0.7])
    rows = logits.repeat_interleave(20000, dim=0)
    never = torch.zeros(rows.shape[0], dtype=torch.bool)
    picks = pick_tokens(rows.clone(), Sampling(greedy=False), temperature, 5, never)
    counts = torch.stack([torch.bincount(p, minlength=6) for p in picks.view(2, -1)])
    freq = counts.float() / 20000
    assert (freq - (logits / 0.7).softmax(dim=-1)).abs().max() < 0.015


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.6), (4, 0.8)])
def test_top_k_and_top_p_keep_the_tokens_generate_keeps(top_k, top_p):
    """The tokens that can be drawn are exactly those Hugging Face's warpers leave."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(3, 12) * 3
    hf = logits.clone()
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1.0:
        hf = TopPLogitsWarper(top_p)(None, hf)
    allowed = torch.isfinite(hf)
    rows = logits.repeat_interleave(4000, dim=0)
    never = torch.zeros(rows.shape[0], dtype=torch.bool)
    picks = pick_tokens(rows, Sampling(False, top_k, top_p), torch.tensor([1.0]), 11, never)
    drawn = torch.zeros_like(allowed)
    for row, token in zip(range(rows.shape[0]), picks.tolist(), strict=True):
        drawn[row // 4000, token] = True
    assert torch.equal(drawn, allowed)


def test_static_engine_is_refused_with_fsdp(tmp_path):
    with pytest.raises(ConfigError) as err:
        small_manifest(tmp_path, rollout={"engine": "static"}, distributed={"fsdp": True})
    message = str(err.value)
    assert "rollout.engine ('static')" in message and "engine: hf" in message


def test_grpo_member_learns_with_static_rollouts(tmp_path):
    """12 GRPO steps on the letters task, every rollout through the static decoder: held-out
    reward (32 prompts, greedy, also through it) from the untrained 0.19 up by more than 0.15,
    as with ``generate``."""
    torch.manual_seed(0)
    manifest = small_manifest(
        tmp_path,
        rollout={"engine": "static", "max_output_tokens": 12},
        algorithm={"group_size": 8, "prompts_per_step": 8},
        task={"eval_size": 32},
    )
    member = Member(manifest, CPU)
    task, learner = member.task, member.learner
    before = learner.evaluate(task.eval, task.reward)
    for _ in range(12):
        learner.train_step(task.train, task.reward)
    after = learner.evaluate(task.eval, task.reward)
    assert after > before + 0.15, (before, after)
    assert learner.model.pbt_static_decoder is not None  # the static path really ran


def test_a_decoder_keeps_a_bounded_number_of_shapes(member):
    """Every batch shape gets its own cache (and graph on GPU); past ``KEPT_SHAPES`` the least
    recently used is dropped, and a shape met again is rebuilt with the same output."""
    from pbt.algorithms.rollout import static as static_rollout

    _randomise(member, 4)
    learner = member.learner
    cfg = dataclasses.replace(learner.rollout_cfg, engine="static", max_output_tokens=4)
    first = generate(learner.model, learner.tokenizer, QUESTIONS[:1], cfg, greedy=True)
    for rows in range(2, static_rollout.KEPT_SHAPES + 3):
        generate(learner.model, learner.tokenizer, QUESTIONS[:1] * rows, cfg, greedy=True)
    decoder = learner.model.pbt_static_decoder
    assert len(decoder._states) == static_rollout.KEPT_SHAPES
    again = generate(learner.model, learner.tokenizer, QUESTIONS[:1], cfg, greedy=True)
    assert torch.equal(first.completion_ids, again.completion_ids)
