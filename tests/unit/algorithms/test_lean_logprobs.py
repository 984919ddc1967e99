"""The lean log-prob path (chunked output layer, padding trimmed) against the full logits."""

from __future__ import annotations

import pytest
import torch
from support import small_manifest

from pbt.algorithms.rollout import hf as rollout
from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
from pbt.algorithms.runtime.member import Member

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lean")
    sections = {"rollout": {"max_output_tokens": 12}, "algorithm": {"prompts_per_step": 4}}
    member = Member(small_manifest(tmp, **sections), CPU)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an adapter that matters, so its gradients are not trivial
        for _, p in member.learner.named_params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return member


def _padded(batch: RolloutBatch, pad_id: int) -> RolloutBatch:
    """The batch with uneven completions (later rows cut short) and extra all-padding columns
    on both sides, as a micro-batch of a bigger batch has."""
    mask = batch.completion_mask.clone()
    for row in range(len(batch)):
        mask[row, 3 + row % 5 :] = 0.0
    pad = torch.nn.functional.pad
    return RolloutBatch(
        pad(batch.prompt_ids, (3, 0), value=pad_id),
        pad(batch.prompt_mask, (3, 0), value=0),
        pad(batch.completion_ids.masked_fill(mask == 0, pad_id), (0, 4), value=pad_id),
        pad(mask, (0, 4), value=0.0),
        batch.texts,
    )


def _logprobs_and_grads(member, batch, lean: bool):
    model = member.learner.model
    model.zero_grad()
    if lean:
        logp = sequence_logprobs(model, batch, 0.8)
    else:
        logp = rollout._full_logits_logprobs(model, batch, 0.8)
    (logp * batch.completion_mask).sum().backward()
    grads = [p.grad.clone() for _, p in member.learner.named_params]
    return logp.detach(), grads


@pytest.mark.parametrize("chunk_bytes", [rollout.LOGIT_CHUNK_BYTES, 4 * 1024 * 64])
def test_lean_logprobs_and_gradients_equal_the_full_logits(member, monkeypatch, chunk_bytes):
    """Same log-probs on every real token and the same adapter gradients, whether the logits
    go through in one chunk or in many (64 tokens each), with padding columns trimmed."""
    monkeypatch.setattr(rollout, "LOGIT_CHUNK_BYTES", chunk_bytes)
    learner = member.learner
    batch = _padded(
        learner.complete([ex.question for ex in member.task.train[:4]]),
        member.tokenizer.pad_token_id,
    )
    assert rollout.plain_output_layer(learner.model) is not None  # the lean path is taken
    lean, lean_grads = _logprobs_and_grads(member, batch, lean=True)
    full, full_grads = _logprobs_and_grads(member, batch, lean=False)
    mask = batch.completion_mask.bool()
    assert lean.shape == full.shape
    assert torch.allclose(lean[mask], full[mask], atol=1e-5)
    assert (lean[:, -4:] == 0).all()  # the all-padding columns were never computed
    for a, b in zip(lean_grads, full_grads, strict=True):  # to float32 rounding at b's scale
        assert torch.allclose(a, b, atol=1e-6 * float(b.abs().max()), rtol=1e-4)
    with torch.no_grad():  # and without gradients
        assert torch.allclose(
            sequence_logprobs(learner.model, batch, 0.8)[mask], full[mask], atol=1e-5
        )


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
def test_a_frozen_heads_gradient_formed_in_forward_equals_autograds(
    monkeypatch, autocast, bias, fused
):
    """The rows' gradient formed beside the log-probs (a frozen output layer) equals
    autograd's through the logits, recomputed in backward, at a temperature, over chunks; in
    float32 to rounding, under bfloat16 autocast to bfloat16's; eager, and with the elementwise
    work compiled (a compiled member's path)."""
    monkeypatch.setattr(rollout, "LOGIT_CHUNK_BYTES", 4 * 300 * 40)  # chunks of 40 rows
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 50, 32, generator=gen)
    weight = torch.randn(300, 32, generator=gen) * 0.3
    b = torch.randn(300, generator=gen) if bias else None
    targets = torch.randint(300, (3, 50), generator=gen)
    upstream = torch.randn(3, 50, generator=gen)

    def run(in_forward: bool):
        monkeypatch.setattr(rollout, "GRADIENT_IN_FORWARD", in_forward)
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp = rollout.chunked_token_logprobs(
                h, weight, b, targets, 0.7, fused=fused and in_forward
            )
        (logp * upstream).sum().backward()
        return logp.detach(), h.grad

    formed, recomputed = run(True), run(False)
    if fused:  # multiplied by 1 / temperature where the eager path divides
        assert torch.allclose(formed[0], recomputed[0], atol=1e-5)
    else:
        assert torch.equal(formed[0], recomputed[0])  # the same forward
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if autocast else {"atol": 1e-6, "rtol": 1e-5}
    assert torch.allclose(formed[1], recomputed[1], **tolerance)
    assert formed[1].abs().max() > 0.1  # a gradient that is not all rounding


def test_an_adapted_output_layer_takes_the_full_logits(member):
    """A LoRA on the output layer is not in its weight: the lean path must not be taken."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pbt.algorithms.runtime.models import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"))
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    assert rollout.plain_output_layer(adapted) is None
    assert rollout.plain_output_layer(member.learner.model) is not None


@pytest.mark.integration
def test_compiled_member_computes_what_the_eager_one_does(member, tmp_path):
    """``training.compile``: the same log-probs and adapter gradients as the eager model (same
    weights), and parameter names unchanged, so checkpoints are the same format."""
    sections = {"rollout": {"max_output_tokens": 12}, "training": {"compile": True}}
    compiled = Member(small_manifest(tmp_path, **sections), CPU)
    assert [n for n, _ in compiled.learner.named_params] == [
        n for n, _ in member.learner.named_params
    ]
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(
            compiled.learner.named_params, member.learner.named_params, strict=True
        ):
            mine.copy_(theirs)
    batch = _padded(
        member.learner.complete([ex.question for ex in member.task.train[:4]]),
        member.tokenizer.pad_token_id,
    )
    want, want_grads = _logprobs_and_grads(member, batch, lean=True)
    got, got_grads = _logprobs_and_grads(compiled, batch, lean=True)
    mask = batch.completion_mask.bool()
    assert torch.allclose(got[mask], want[mask], atol=1e-4)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_compile_with_fsdp_is_refused(tmp_path):
    from pbt.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        small_manifest(tmp_path, training={"compile": True}, distributed={"fsdp": True})
    assert "training.compile (true) is not supported with distributed.fsdp" in str(err.value)
