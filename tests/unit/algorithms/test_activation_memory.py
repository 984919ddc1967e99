"""Activation checkpointing and offloading change memory, never results: a member's gradients
and losses with each knob equal those without it (one rank, and FSDP2 on two CPU ranks for
checkpointing), the knobs demonstrably act (the bytes a training forward keeps drop), and
rollouts run without either."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support import DRIVERS, run_torchrun, small_manifest

from pbt.algorithms.rollout.hf import RolloutBatch, chat_prompts, generate, sequence_logprobs
from pbt.algorithms.runtime.activations import ActivationOffload, checkpoint_blocks
from pbt.algorithms.runtime.member import Member
from pbt.distributed.state import gather_parameters

CPU = torch.device("cpu")
DRIVER = DRIVERS / "grpo_driver.py"
TOL = 1e-6
"""The recompute runs the same float32 ops on the same inputs: equal up to summation order,
which does not change either (observed: bit-identical)."""


def _member(tmp_path: Path, **training: object) -> Member:
    sections = {"algorithm": {"group_size": 4, "prompts_per_step": 2, "micro_batch_size": 4}}
    return Member(small_manifest(tmp_path, training=training, **sections), CPU)


def _batch(member: Member, seed: int, rows: int = 8, length: int = 6) -> RolloutBatch:
    """Prompts of the task with random completions, some shorter: the same for every member."""
    gen = torch.Generator().manual_seed(seed)
    questions = [ex.question for ex in member.task.train[: rows // 4]]
    texts = [p for p in chat_prompts(member.tokenizer, questions) for _ in range(4)]
    enc = member.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    completions = torch.randint(3, len(member.tokenizer), (rows, length), generator=gen)
    mask = torch.ones(rows, length)
    mask[::3, length - 2 :] = 0.0
    return RolloutBatch(enc["input_ids"], enc["attention_mask"], completions, mask, [""] * rows)


def _gradients(member: Member, batch: RolloutBatch) -> tuple[float, dict[str, torch.Tensor]]:
    """One training forward and backward of ``sum(logp * mask)``: the value and the adapter's
    gradients."""
    member.model.train()
    logp = sequence_logprobs(member.model, batch, 1.0)
    value = (logp * batch.completion_mask).sum()
    value.backward()
    grads = {n: p.grad.clone() for n, p in member.learner.named_params}
    member.learner.optimizer.zero_grad(set_to_none=True)
    return float(value.detach()), grads


def _losses(member: Member, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` GRPO updates on fixed batches and rewards: each step's loss, then the adapter."""
    out = []
    for step in range(steps):
        batch = _batch(member, step)
        rewards = torch.rand(len(batch), generator=torch.Generator().manual_seed(100 + step))
        out.append(member.learner.learn(batch, rewards)["loss"])
    return out, gather_parameters(member.learner.named_params)


def _saved_bytes(member: Member, batch: RolloutBatch) -> int:
    """Bytes of the distinct storages a training forward keeps for backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    member.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_logprobs(member.model, batch, 1.0).sum()
    return sum(storages.values())


def _assert_same(a: tuple, b: tuple) -> None:
    (value_a, grads_a), (value_b, grads_b) = a, b
    assert value_b == pytest.approx(value_a, abs=TOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=0, atol=TOL)
    assert any(g.abs().sum() > 0 for g in grads_a.values())


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A member without either knob: its gradients on one batch, its losses over three steps,
    and the bytes its training forward keeps."""
    member = _member(tmp_path_factory.mktemp("plain"))
    batch = _batch(member, 0)
    return {
        "grads": _gradients(member, batch),
        "saved": _saved_bytes(member, batch),
        "losses": _losses(member),
    }


def test_checkpointing_gives_the_same_gradients_and_losses(plain: dict, tmp_path: Path):
    member = _member(tmp_path, activation_checkpointing=True)
    batch = _batch(member, 0)
    _assert_same(plain["grads"], _gradients(member, batch))
    # it acts: the forward keeps far less (block inputs instead of every intermediate)
    assert _saved_bytes(member, batch) < 0.5 * plain["saved"]
    losses, adapter = _losses(member)
    assert losses == pytest.approx(plain["losses"][0], abs=TOL)
    for name, tensor in plain["losses"][1].items():
        torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=TOL)


def test_offloading_gives_the_same_gradients_and_losses(plain: dict, tmp_path: Path):
    """The hooks on the CPU (host to host): every saved activation goes through the copy and
    back, and nothing changes."""
    member = _member(tmp_path)
    offload = ActivationOffload(CPU, min_bytes=0)
    offload.install(member.model)
    batch = _batch(member, 0)
    _assert_same(plain["grads"], _gradients(member, batch))
    assert offload.offloaded_bytes > 0.5 * plain["saved"]
    losses, adapter = _losses(member)
    assert losses == pytest.approx(plain["losses"][0], abs=TOL)
    for name, tensor in plain["losses"][1].items():
        torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=TOL)


def test_both_knobs_together_give_the_same_gradients(plain: dict, tmp_path: Path):
    member = _member(tmp_path, activation_checkpointing=True)
    offload = ActivationOffload(CPU, min_bytes=0)
    offload.install(member.model)
    _assert_same(plain["grads"], _gradients(member, _batch(member, 0)))
    # with checkpointing only the blocks' inputs (and what lies outside the blocks) travel
    assert 0 < offload.offloaded_bytes < 0.5 * plain["saved"]


def test_offloading_copies_a_storage_once_and_restores_every_view():
    x = torch.randn(4, 6, requires_grad=True)
    w1, w2 = torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(6))
    with torch.no_grad():
        h = x * 2.0
    h.requires_grad_()
    with ActivationOffload(CPU, min_bytes=0) as offload:
        # h is saved by the matmul (as itself) and by the mul (as a transposed view)
        out = (h @ w1).sum() + (h.t() * w2.unsqueeze(1)).sum()
    assert offload.offloaded_bytes == h.numel() * h.element_size()
    out.backward()
    expected_w1 = h.detach().sum(0).unsqueeze(1).expand(6, 3)
    torch.testing.assert_close(w1.grad, expected_w1)
    torch.testing.assert_close(w2.grad, h.detach().sum(0))


def test_offloading_leaves_parameters_small_tensors_and_untracked_passes_alone():
    linear = torch.nn.Linear(8, 8)
    offload = ActivationOffload(CPU, min_bytes=4 * 8 * 16)
    offload.install(linear)
    linear(torch.randn(16, 8, requires_grad=True)).sum()  # the input: exactly min_bytes
    assert offload.offloaded_bytes == 4 * 8 * 16  # the input only, not the weight
    linear(torch.randn(15, 8, requires_grad=True)).sum()
    assert offload.offloaded_bytes == 0  # below min_bytes
    with torch.no_grad():
        linear(torch.randn(64, 8))
    assert offload.offloaded_bytes == 0  # nothing recorded, nothing moved


def test_rollouts_never_recompute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Decoding (HF generate and the static decoder) runs without gradients, so the
    checkpointed blocks run plainly and sample what they sample without checkpointing."""
    member = _member(tmp_path)
    questions = [ex.question for ex in member.task.train[:3]]
    cfg = member.manifest.rollout
    greedy = {
        engine: generate(
            member.model, member.tokenizer, questions, _engine(cfg, engine), greedy=True
        )
        for engine in ("hf", "static")
    }
    calls = []
    original = torch.utils.checkpoint.checkpoint

    def counted(function, *args, **kwargs):
        calls.append(getattr(function, "__self__", None))  # the block, for a block's forward
        return original(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counted)
    blocks = checkpoint_blocks(member.model)
    for engine, before in greedy.items():
        for mode in (member.model.eval, member.model.train):
            mode()
            after = generate(
                member.model, member.tokenizer, questions, _engine(cfg, engine), greedy=True
            )
            assert torch.equal(after.completion_ids, before.completion_ids), (engine, mode)
    assert calls == []
    sequence_logprobs(member.model, _batch(member, 0), 1.0)
    assert sum(isinstance(c, torch.nn.Module) for c in calls) == blocks == 2  # once per block


def _engine(cfg, engine: str):
    import dataclasses

    return dataclasses.replace(cfg, engine=engine, cuda_graphs=False)


def test_offloading_on_the_cpu_is_a_note_not_a_hook(tmp_path: Path):
    member = _member(tmp_path, activation_offloading=True)
    hooks = member.model._forward_pre_hooks
    assert not hooks  # nothing installed on the CPU
    notes = member.manifest.notes()
    assert any("activation_offloading (true) has no effect on the CPU" in n for n in notes)
    assert not any("activation_offloading" in n for n in small_manifest(tmp_path).notes())


@pytest.mark.integration
def test_checkpointing_under_fsdp2_gives_the_one_rank_losses(tmp_path: Path):
    """Two CPU ranks, FSDP2 with checkpointed blocks, against one rank without checkpointing."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(DRIVER), str(one), "--steps", "3"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_torchrun(str(DRIVER), str(two), "--steps", "3", "--fsdp", "--checkpointing")
    plain, sharded = json.loads(one.read_text()), json.loads(two.read_text())
    assert (plain["checkpointed"], sharded["checkpointed"]) == (0, 2)  # both tiny blocks
    a, b = plain["losses"], sharded["losses"]
    assert a.keys() == b.keys() == {"1", "2", "3"}
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5)
    adapter_a, adapter_b = torch.load(f"{one}.pt"), torch.load(f"{two}.pt")
    # tolerances as tests/integration/test_distributed.py's, and for the same reason
    for key in adapter_a:
        torch.testing.assert_close(adapter_b[key], adapter_a[key], rtol=1e-3, atol=5e-5)
