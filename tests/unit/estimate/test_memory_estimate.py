"""The memory estimate: its arithmetic on a hand-computed case, its activation term against what
autograd really saves on the CPU, its agreement with the GPU figures in bench/RESULTS.md, the
knobs it names, and ``pbt estimate-memory`` and ``pbt check``'s warning as a user sees them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import small_sections

from pbt.config.errors import ConfigError
from pbt.config.read.loader import manifest_from_dict
from pbt.estimate import memory
from pbt.estimate.memory import (
    GIB,
    Plan,
    adapter_params,
    advice,
    estimate,
    layer_bytes,
    plan_from_manifest,
)
from pbt.estimate.model_shape import ModelShape, read_model_shape, shape_from_config

SMALL = ModelShape(
    hidden=8, layers=2, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=32, tied=False
)
SMALL_PLAN = Plan(micro_batch=2, prompt_tokens=3, completion_tokens=5, lora_r=2)
QWEN_05B = ModelShape(
    hidden=896, layers=24, intermediate=4864, heads=14, kv_heads=2, head_dim=64, vocab=151936,
    tied=True,
)  # fmt: skip
QWEN_15B = dataclasses.replace(
    QWEN_05B, hidden=1536, layers=28, intermediate=8960, heads=12, head_dim=128
)
QWEN_7B = ModelShape(
    hidden=3584, layers=28, intermediate=18944, heads=28, kv_heads=4, head_dim=128, vocab=152064,
    tied=False,
)  # fmt: skip
QWEN_72B = dataclasses.replace(
    QWEN_7B, hidden=8192, layers=80, intermediate=29568, heads=64, kv_heads=8
)
QWEN_110B = dataclasses.replace(QWEN_72B, intermediate=49152)
"""Qwen1.5-110B's shape with Qwen2.5's vocabulary, as bench/activation_memory.py builds it."""


def test_the_arithmetic_of_a_hand_computed_case():
    """hidden 8, 2 layers, MLP 16, 2 heads of 4 (1 key/value head), vocabulary 32, bf16 base
    with mixed precision, LoRA r 2 on the 7 projections, 2 x (3 + 5) tokens per forward."""
    # per block: projections 64+32+32+64+128+128+128, q/k/v biases 16, two norms 16 = 608
    assert SMALL.block_params() == 608
    assert SMALL.params() == 2 * 32 * 8 + 2 * 608 + 8 == 1736
    # r x (in + out): 2 x (16+12+12+16+24+24+24) per layer
    assert adapter_params(SMALL, SMALL_PLAN) == 2 * 256 == 512
    # norms 2 x 4 x (8 + 1); SDPA 2 x (2x8 + 2x4) + 4 x 2 heads; MLP 2 x 3 x 16; lora_A
    # outputs 2 x 2 x 7; each adapted input copied (half base, float32 adapters): 2 x (6x8 + 16)
    assert layer_bytes(SMALL, SMALL_PLAN) == 72 + 56 + 96 + 28 + 128 == 380
    result = estimate(SMALL, SMALL_PLAN)
    terms = {t.name: t.bytes for t in result.persistent + result.training}
    assert terms == {
        "base weights": 1736 * 2,
        "adapter, gradients, optimizer": 512 * 18,
        # 16 tokens x 2 layers x 380, and the final norm's float32 input and the head's input
        "activations": 16 * 2 * 380 + 16 * (4 + 2) * 8,
        # one chunk of 2 x 5 rows: 2 float32 copies of 10 x 32 logits, and the 10 rows'
        # float32 gradients (8 wide) that the frozen output layer forms in the forward pass
        "log-prob logits": 2 * 10 * 32 * 4 + 10 * 8 * 4,
    }
    assert result.peak == 3472 + 9216 + (12160 + 768) + 2880
    assert result.per_gpu == result.peak + 0.5 * GIB
    # the logits recomputed in the backward pass instead: 4 float32 copies of the chunk
    recomputed = estimate(SMALL, dataclasses.replace(SMALL_PLAN, head_gradient_in_forward=False))
    assert _term(recomputed.training, "log-prob logits") == 4 * 10 * 32 * 4


def test_the_activation_knobs_on_the_hand_computed_case(monkeypatch: pytest.MonkeyPatch):
    """What stays held at the start of backward, and a block's backward working set counted
    only beyond the logits (2,880 bytes here) it follows; a recomputed block's with the MLP's
    three gradients of 16 x 2 bytes a token."""
    outside, layer, block_input, logits = 16 * 6 * 8, 16 * 380, 16 * 16, 2880
    grads = 16 * 3 * 16 * 2
    checkpointed = estimate(SMALL, dataclasses.replace(SMALL_PLAN, checkpointing=True))
    # each layer's input (8 x 2 bytes per token); one block recomputed after the logits
    assert _term(checkpointed.training, "activations") == 2 * block_input + outside
    assert _term(checkpointed.training, "backward working set") == layer + grads - logits
    offloaded = estimate(SMALL, dataclasses.replace(SMALL_PLAN, offloading=True))
    # the head's input, then blocks brought back: with two layers the device never holds
    # more than plain training's activations
    assert _term(offloaded.training, "activations") == 16 * 2 * 8
    assert _training(offloaded) == 2 * layer + outside
    assert _term(offloaded.host, "offloaded activations") == 2 * layer + outside
    # deeper, with a prefetch of 1000 bytes: one block back and the prefetch in backward
    monkeypatch.setattr(memory, "OFFLOAD_PREFETCH_BYTES", 1000)
    deep = dataclasses.replace(SMALL, layers=40)
    offloaded = estimate(deep, dataclasses.replace(SMALL_PLAN, offloading=True))
    assert _term(offloaded.training, "activations") == 16 * 2 * 8
    assert _term(offloaded.training, "backward working set") == layer + 1000 - logits
    assert _term(offloaded.host, "offloaded activations") == 40 * layer + outside
    both = estimate(deep, dataclasses.replace(SMALL_PLAN, offloading=True, checkpointing=True))
    # the head's input and one block input in flight; one block recomputed from its input
    # brought back, and the prefetch; every input on the host
    assert _term(both.training, "activations") == 16 * 2 * 8 + block_input
    working = layer + grads + block_input + 1000
    assert _term(both.training, "backward working set") == working - logits
    assert _term(both.host, "offloaded block inputs") == 40 * block_input + outside
    # a working set smaller than the logits adds nothing
    wide = dataclasses.replace(SMALL, vocab=3200)
    small = estimate(wide, dataclasses.replace(SMALL_PLAN, checkpointing=True))
    assert not [t for t in small.training if t.name == "backward working set"]


def _training(result) -> float:
    return sum(t.bytes for t in result.training)


def test_the_quantized_base_terms():
    """QLoRA: the blocks' projections at half a byte a weight plus their constants (a float32
    absmax per 64 weights; double-quantized, one byte per 64 and a float32 per 256 of those),
    the rest at the weight's bytes; one block's projections dequantized in flight."""
    matrices = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 128)  # 2 layers of the SMALL shape
    plan = dataclasses.replace(SMALL_PLAN, quantized=True, double_quant=False)
    result = estimate(SMALL, plan)
    rest = 1736 - matrices
    assert _term(result.persistent, "base weights") == matrices * (0.5 + 4 / 64) + rest * 2
    assert _term(result.training, "dequantized weights in flight") == matrices // 2 * 2
    double = estimate(SMALL, dataclasses.replace(plan, double_quant=True))
    per = 0.5 + (1 + 4 / 256) / 64
    assert _term(double.persistent, "base weights") == pytest.approx(matrices * per + rest * 2)
    # a 7B base: 6.5B projection weights at 0.516 bytes, 1.1B embedding and output weights at 2
    seven = Plan(micro_batch=1, lora_r=16)
    bf16 = _term(estimate(QWEN_7B, seven).persistent, "base weights")
    nf4 = _term(estimate(QWEN_7B, dataclasses.replace(seven, quantized=True)).persistent,
                "base weights")  # fmt: skip
    assert bf16 / GIB == pytest.approx(14.19, abs=0.01)
    assert nf4 / GIB == pytest.approx(5.17, abs=0.01)
    # sharded: the 4-bit blocks gathered two at a time
    sharded = dataclasses.replace(plan, fsdp=True, ranks=2, autocast=False)
    gathered = _term(estimate(SMALL, sharded).training, "FSDP2 gathered weights")
    block = matrices // 2 * (0.5 + 4 / 64) + (608 - matrices // 2) * 2
    assert gathered == 2 * block + 32 * 8 * 2


def test_rollout_and_sharing_terms():
    plan = dataclasses.replace(SMALL_PLAN, rollouts=6, eval_rollouts=4)
    kv = 2 * 2 * 4 * 2  # keys and values, 2 layers, 4 wide, 2 bytes: per token
    generate = estimate(SMALL, plan)
    assert _term(generate.rollout, "KV cache") == 6 * 8 * kv
    static = estimate(SMALL, dataclasses.replace(plan, engine="static"))
    assert _term(static.persistent, "static KV cache") == (6 + 4) * 64 * kv  # rounded up to 64
    vllm = dataclasses.replace(plan, engine="vllm", vllm_share=0.25)
    asleep = estimate(SMALL, vllm, gpu_bytes=80 * GIB)
    assert _term(asleep.rollout, "vLLM engine") == 20 * GIB
    assert asleep.phase == "rollout" and asleep.peak == pytest.approx(20 * GIB, rel=1e-3)
    awake = estimate(SMALL, dataclasses.replace(vllm, vllm_sleeps=False), gpu_bytes=80 * GIB)
    assert _term(awake.persistent, "vLLM engine") == 20 * GIB
    sharded = estimate(SMALL, dataclasses.replace(SMALL_PLAN, fsdp=True, ranks=2, autocast=False))
    assert _term(sharded.persistent, "base weights") == 1736 * 2 / 2
    assert _term(sharded.training, "FSDP2 gathered weights") == (2 * 608 + 32 * 8) * 2
    three = estimate(SMALL, dataclasses.replace(SMALL_PLAN, members_per_gpu=3))
    assert three.per_gpu == 3 * (three.peak + 0.5 * GIB)


def test_a_batch_of_members_is_what_its_worker_holds(tmp_path: Path):
    """A worker batching 3 members (``launch.members_per_batch: 3``): the estimate's members'
    adapters and AdamW moments and the stacked adapters equal what a real population of 3 on
    one base holds after a step of each (the tiny model, CPU); the rollout and the static cache
    take the 3 members' rows; ``batched_train`` adds their rows to a training forward; the
    knob that lowers it is a smaller batch."""
    from pbt import create_population

    sections = small_sections(
        tmp_path, rollout={"engine": "static"}, launch={"members_per_batch": 3}
    )  # fmt: skip
    manifest = manifest_from_dict(sections, base_dir=tmp_path)
    plan = plan_from_manifest(manifest)
    assert (plan.members_per_batch, plan.batched_train, plan.together) == (3, False, 1)
    pop = create_population(config=sections, population_size=3)
    for agent in pop:
        prompts = agent.sample_prompts()
        batch = pop.get_actions({agent: prompts})[agent]
        agent.learn(batch, agent.reward(prompts, batch))
    pop.get_actions({agent: agent.sample_prompts() for agent in pop})  # the stacked adapters
    held = pop.memory_bytes()
    shared = pop._shared()
    stacked = sum(
        t.numel() * t.element_size() for t in shared.row_adapters.a + shared.row_adapters.b
    )
    shape = read_model_shape(manifest)
    result = estimate(shape, plan)
    steps = 3 * 4 * len(shared.params)  # AdamW's step count: a float32 scalar a tensor
    assert _term(result.persistent, "3 members' adapters, optimizers") + steps == held["members"]
    assert _term(result.persistent, "stacked adapters of the batch") == stacked
    alone = estimate(shape, dataclasses.replace(plan, members_per_batch=1))
    assert _term(result.persistent, "static KV cache") == 3 * _term(
        alone.persistent, "static KV cache"
    )
    assert _term(result.rollout, "sampling logits") == 3 * _term(alone.rollout, "sampling logits")
    assert result.training == alone.training  # the members learn in turn
    batched = dataclasses.replace(plan, batched_train=True)
    together = estimate(shape, batched)
    tokens = 3 * plan.micro_batch * plan.sequence  # the 3 members' rows in one forward
    per_token = shape.layers * layer_bytes(shape, batched) + (4 + 2) * shape.hidden
    assert _term(together.training, "activations") == tokens * per_token
    assert "stacked adapters' gradients" in {t.name for t in together.training}
    knobs = advice(shape, plan, gpu_bytes=together.per_gpu / 2)
    assert any(k.setting == "launch.members_per_batch: 1" for k in knobs)


def _term(terms, name: str) -> float:
    (value,) = [t.bytes for t in terms if t.name == name]
    return value


@pytest.mark.parametrize("autocast", [False, True])
def test_the_activation_term_is_what_autograd_saves(autocast: bool):
    """On the CPU, through the real model: the bytes of the distinct storages a training forward
    saves grow by exactly :func:`layer_bytes` per token with each block (a float32 model, and a
    bf16 one under autocast as mixed precision runs it on CUDA; under autocast each block also
    keeps the half copies of its adapter's weights, which the estimate counts with the
    adapter)."""
    saved = {layers: _saved_bytes(layers, autocast) for layers in (2, 3)}
    shape = shape_from_config(_config(2), "test")
    plan = Plan(
        weight_bytes=2 if autocast else 4, autocast=autocast, lora_r=8, micro_batch=2
    )  # fmt: skip
    tokens = 2 * 24
    casts = 2 * adapter_params(shape, plan) // shape.layers if autocast else 0
    assert saved[3] - saved[2] == layer_bytes(shape, plan) * tokens + casts


def _config(layers: int) -> dict:
    return {
        "model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": False,
    }  # fmt: skip


def _saved_bytes(layers: int, autocast: bool, members: int = 1, kernel: str = "") -> int:
    """Bytes of the storages a training forward saves: one member's (``sequence_logprobs``),
    or with ``members`` > 1 a batched pass of that many members' rows through ``kernel``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pbt.algorithms.passes import LogProbs
    from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
    from pbt.algorithms.runtime.lora_batch import RowAdapters
    from pbt.algorithms.runtime.models import add_lora
    from pbt.algorithms.runtime.population_train import logprobs_together
    from pbt.config import LoRAConfig

    torch.manual_seed(0)
    config = _config(layers)
    config.pop("model_type")
    dtype = torch.bfloat16 if autocast else torch.float32
    base = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=dtype)
    base.requires_grad_(False)
    model = add_lora(base, LoRAConfig(r=8))
    model.train()
    ids = torch.randint(128, (2, 24))
    batch = RolloutBatch(ids[:, :8], torch.ones(2, 8, dtype=torch.long), ids[:, 8:],
                         torch.ones(2, 16), ["", ""])  # fmt: skip
    storages: dict[int, int] = {}
    held: set[int] = set()  # the stacked adapters: held anyway (the estimate's persistent term)

    def pack(t):
        base = t._base if t._base is not None else t
        pointer = t.untyped_storage().data_ptr()
        if not isinstance(base, torch.nn.Parameter) and pointer not in held:
            storages[pointer] = t.untyped_storage().nbytes()
        return t

    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    if members == 1:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            sequence_logprobs(model, batch, 1.0)
        return sum(storages.values())
    adapters = RowAdapters(model, members)
    for slot in range(members):
        with torch.no_grad():
            for param in (p for p in model.parameters() if p.requires_grad):
                param.normal_(0.0, 0.02)
        adapters.load_from_model(slot)
    for t in adapters.a + adapters.b:
        t.requires_grad_(True)
        held.add(t.untyped_storage().data_ptr())
    asks = {f"m{i}": LogProbs(batch, 1.0, grad=True) for i in range(members)}
    slots = {member_id: slot for slot, member_id in enumerate(asks)}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        logprobs_together(model, adapters, slots, asks, kernel)
    return sum(storages.values())


@pytest.mark.parametrize("kernel", ["segmented", "stacked"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_batched_train_pass_saves_what_the_estimate_says(kernel: str, autocast: bool):
    """The same count for ``launch.batched_train``'s forward of 3 members' rows through the
    per-row kernels (``logprobs_together``): each block saves :func:`layer_bytes` of the
    batch's plan per token (the inputs shared, the stacked kernel's products every member's
    ``r`` wide), and under autocast the half copies of every member's adapter, which the
    estimate counts with the stacked adapters' gradients."""
    members = 3
    saved = {layers: _saved_bytes(layers, autocast, members, kernel) for layers in (2, 3)}
    shape = shape_from_config(_config(2), "test")
    plan = Plan(
        weight_bytes=2 if autocast else 4, autocast=autocast, lora_r=8, micro_batch=2,
        members_per_batch=members, batched_train=True, stacked=kernel == "stacked",
    )  # fmt: skip
    tokens = members * 2 * 24
    copies = {"stacked adapters' half copies", "stacked B, side by side"}
    terms = memory._training(shape, plan)[0]
    per_block = sum(t.bytes for t in terms if t.name in copies) // shape.layers
    assert saved[3] - saved[2] == layer_bytes(shape, plan) * tokens + per_block
    alone = dataclasses.replace(plan, members_per_batch=1, batched_train=False)
    assert layer_bytes(shape, plan) != layer_bytes(shape, alone) or not autocast


def test_a_recomputed_block_holds_the_mlp_gradients_beside_its_saved_tensors():
    """What a checkpointed block's recompute and backward hold at most, beyond the block
    inputs held before (counted on the CPU by following every tensor's storage): its saved
    tensors and the MLP's three gradients, :func:`mlp_gradient_bytes`. Two intermediate sizes
    separate the gradients, which grow with it, from what does not."""
    from pbt.estimate.memory import mlp_gradient_bytes

    plan = Plan(lora_r=8)
    tokens = 2 * 128
    small, large = (_recompute_working_set(i, tokens) for i in (512, 1024))
    shapes = [shape_from_config(_wide_config(i), "t") for i in (512, 1024)]
    per_token = [layer_bytes(s, plan) + mlp_gradient_bytes(s, plan) for s in shapes]
    assert large - small == (per_token[1] - per_token[0]) * tokens


def _wide_config(intermediate: int) -> dict:
    return {**_config(1), "hidden_size": 256, "head_dim": 64, "intermediate_size": intermediate}


def _recompute_working_set(intermediate: int, tokens: int) -> int:
    """The most bytes one checkpointed block's step holds beyond what it holds when backward
    starts (bf16 base under autocast, as on CUDA)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
    from pbt.algorithms.runtime.activations import checkpoint_blocks
    from pbt.algorithms.runtime.models import add_lora
    from pbt.config import LoRAConfig

    class Live(TorchDispatchMode):
        """Bytes of the storages that ops create, while they live."""

        def __init__(self, known: list) -> None:
            super().__init__()
            self.refs = {t.untyped_storage()._cdata: (StorageWeakRef(t.untyped_storage()), 0)
                         for t in known}  # fmt: skip
            self.live = self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
                self.live -= self.refs.pop(key)[1]
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.refs:
                    storage = t.untyped_storage()
                    self.refs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            return out

    torch.manual_seed(0)
    config = _wide_config(intermediate)
    config.pop("model_type")
    base = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=torch.bfloat16)
    model = add_lora(base.requires_grad_(False), LoRAConfig(r=8)).train()
    checkpoint_blocks(base)
    ids = torch.randint(128, (2, tokens // 2))
    batch = RolloutBatch(ids[:, :16], torch.ones(2, 16, dtype=torch.long), ids[:, 16:],
                         torch.ones(2, tokens // 2 - 16), ["", ""])  # fmt: skip
    live = Live([*model.parameters(), *model.buffers()])
    with live:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = -sequence_logprobs(model, batch, 1.0).mean()
        held, live.peak = live.live, 0
        loss.backward()
    return live.peak - held


@pytest.mark.parametrize(
    ("shape", "plan", "measured"),
    [
        (QWEN_05B, Plan(micro_batch=16), 14.3),
        (QWEN_15B, Plan(micro_batch=16), 28.7),
        (QWEN_7B, Plan(micro_batch=4, fsdp=True, ranks=2, autocast=False, moments_on_host=True), 22.3),
    ],
    ids=["0.5b", "1.5b", "7b-fsdp2"],
)  # fmt: skip
def test_agrees_with_the_measured_h200_peaks(shape, plan, measured):
    """bench/RESULTS.md's allocator peaks ("The train step", mixed precision; the 7B member
    under FSDP2 on 2 ranks): LoRA r 16, 64 prompt + 448 completion tokens. A sanity check of the
    first-principles terms, within 3%; the issue's own accuracy goal is 15%. Measured with the
    output layer's logits recomputed in the backward pass."""
    plan = dataclasses.replace(
        plan, lora_r=16, prompt_tokens=64, completion_tokens=448, head_gradient_in_forward=False
    )
    assert estimate(shape, plan).peak / GIB == pytest.approx(measured, rel=0.03)


H200_ROWS = {
    ("0.5b", 4, "recomputed"): {
        "plain": 25.583,
        "activation_checkpointing": 3.857,
        "activation_offloading": 3.148,
        "both": 3.146,
        "qlora": 25.085,
        "qlora+activation_checkpointing": 3.361,
        "qlora+activation_offloading": 2.652,
        "qlora+both": 2.650,
    },
    ("0.5b", 4, "in forward"): {
        "plain": 24.638,
        "activation_checkpointing": 3.263,
        "activation_offloading": 2.345,
        "both": 2.900,
    },
    ("1.5b", 4, "recomputed"): {
        "plain": 52.214,
        "activation_checkpointing": 7.199,
        "activation_offloading": 5.252,
        "both": 6.222,
        "qlora": 50.442,
        "qlora+activation_checkpointing": 5.425,
        "qlora+activation_offloading": 3.478,
        "qlora+both": 4.448,
    },
    ("1.5b", 4, "in forward"): {
        "plain": 51.301,
        "activation_checkpointing": 7.199,
        "activation_offloading": 5.001,
        "both": 6.222,
    },
    ("7b", 2, "recomputed"): {
        "plain": 68.216,
        "activation_checkpointing": 19.272,
        "activation_offloading": 16.875,
        "both": 18.140,
        "qlora": 59.186,
        "qlora+activation_checkpointing": 10.246,
        "qlora+activation_offloading": 7.855,
        "qlora+both": 9.119,
    },
    ("72b", 4, "recomputed"): {"qlora+both": 52.836},
    ("110b", 4, "recomputed"): {"qlora+both": 76.522},
}
H200_SHAPES = {
    "0.5b": QWEN_05B,
    "1.5b": QWEN_15B,
    "7b": QWEN_7B,
    "72b": QWEN_72B,
    "110b": QWEN_110B,
}
"""bench/RESULTS.md's tables "Activation memory and QLoRA" (allocator peaks, GiB, one H200):
``bench/activation_memory.py --shape SHAPE --device cuda --batch BATCH --completion 4032
--modes all`` (the 72B and 110B shapes: ``--modes qlora+both --by-block``), LoRA r 16, mixed
precision, 64 prompt + 4,032 completion tokens a sequence; with the frozen output layer's
logits recomputed in the backward pass, and (the later rows) its gradient formed in the
forward pass, as the code runs now."""


@pytest.mark.parametrize(
    ("shape", "batch", "head", "mode", "measured"),
    [
        (shape, batch, head, mode, peak)
        for (shape, batch, head), peaks in H200_ROWS.items()
        for mode, peak in peaks.items()
    ],
)
def test_the_knobs_and_a_4bit_base_agree_with_the_h200(
    shape: str, batch: int, head: str, mode: str, measured: float
):
    """The bench's exact workload through the estimate (the arithmetic of ``pbt
    estimate-memory``), within 15% of each peak measured on the H200: each activation knob
    alone and together, on a half and on a 4-bit base (quantized in memory, so peft's generic
    LoRA layer), from 0.5B to the largest shape that trained there."""
    plan = Plan(
        micro_batch=batch,
        prompt_tokens=64,
        completion_tokens=4032,
        lora_r=16,
        checkpointing="checkpointing" in mode or mode.endswith("both"),
        offloading="offloading" in mode or mode.endswith("both"),
        quantized=mode.startswith("qlora"),
        double_quant=True,
        generic_lora_on_4bit=True,
        head_gradient_in_forward=head == "in forward",
    )
    assert estimate(H200_SHAPES[shape], plan).peak / GIB == pytest.approx(measured, rel=0.15)


def test_the_knobs_that_make_a_member_fit():
    plan = Plan(
        micro_batch=16, lora_r=16, prompt_tokens=64, completion_tokens=448, members_per_gpu=2
    )
    gpu = 40 * GIB
    assert estimate(QWEN_15B, plan, gpu).per_gpu > gpu
    knobs = {k.setting: k for k in advice(QWEN_15B, plan, gpu, gpus=1)}
    fitting = [s for s, k in knobs.items() if k.fits(gpu)]
    assert "training.activation_checkpointing: true" in fitting
    assert "launch.members_per_gpu: 1" in fitting
    # the largest micro-batch that fits: 2 x (5.2 GiB + 8 x 1.47 GiB of activations + 0.5)
    assert "algorithm.micro_batch_size: 8" in fitting
    assert "distributed.fsdp: true, launch.gpus_per_member: 2" in knobs
    # every knob lowers the estimate
    assert all(k.estimate.per_gpu < estimate(QWEN_15B, plan, gpu).per_gpu for k in knobs.values())


def test_the_plan_of_a_manifest(tmp_path: Path):
    sections = small_sections(tmp_path)
    m = manifest_from_dict(sections, base_dir=tmp_path)
    plan = plan_from_manifest(m, prompt_tokens=100)
    assert (plan.micro_batch, plan.rollouts, plan.sequence) == (8, 8, 106)
    assert (plan.weight_bytes, plan.autocast, plan.adapters, plan.per_example) == (2, True, 1, 1)
    sharded = _with(
        sections, tmp_path,
        algorithm={"micro_batch_size": 2}, launch={"nproc_per_member": 2},
        distributed={"fsdp": True}, model={"dtype": "float32"},
    )  # fmt: skip
    plan = plan_from_manifest(sharded)
    assert (plan.ranks, plan.fsdp, plan.moments_on_host, plan.micro_batch) == (2, True, True, 2)
    assert (plan.weight_bytes, plan.autocast, plan.rollouts) == (4, False, 4)
    ppo = plan_from_manifest(_with(sections, tmp_path, algorithm={"name": "PPO"}))
    assert ppo.adapters == 2
    # two adapters of r 8 x 128 per layer, 2 layers, and the value head
    assert adapter_params(SMALL, ppo) == 2 * (2 * 8 * 128) + 8 + 1
    dpo = _with(
        {**sections, "task": {"name": "builtin:letters"}}, tmp_path,
        algorithm={"name": "DPO", "prompts_per_step": 4, "beta": 0.1},
    )  # fmt: skip
    plan = plan_from_manifest(dpo)
    assert (plan.per_example, plan.rollouts) == (2, 0)
    knobs = _with(sections, tmp_path, lora={"target_modules": ["q_proj", "v_proj", "lm_head"]})
    assert plan_from_manifest(knobs).adapted == ("q_proj", "v_proj", "lm_head")
    together = {"members_per_batch": 4, "batched_train": True}
    batch = plan_from_manifest(_with(sections, tmp_path, launch=together))
    assert (batch.members_per_batch, batch.together, batch.stacked) == (4, 4, True)
    apart = plan_from_manifest(_with(sections, tmp_path, launch=together, lora={"dropout": 0.1}))
    assert (apart.members_per_batch, apart.together) == (4, 1)  # the members learn in turn
    slurm = {**together, "backend": "slurm"}
    assert plan_from_manifest(_with(sections, tmp_path, launch=slurm)).members_per_batch == 1


def _with(sections: dict, tmp_path: Path, **changes: dict):
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in sections.items()}
    for key, values in changes.items():
        data[key] = {**data.get(key, {}), **values}
    return manifest_from_dict(data, base_dir=tmp_path)


def test_reading_the_model_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sections = small_sections(tmp_path)
    tiny = read_model_shape(manifest_from_dict(sections, base_dir=tmp_path))
    assert (tiny.hidden, tiny.layers, tiny.vocab, tiny.kv_heads) == (128, 2, 1024, 2)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_config(3), "model_type": "qwen3"}))
    local = _with(sections, tmp_path, model={"name": "model"})
    shape = read_model_shape(local)
    assert (shape.layers, shape.head_dim, shape.qk_norm) == (3, 16, True)

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = _with(sections, tmp_path, model={"name": "Org/Model-1B"})
    with pytest.raises(ConfigError) as err:
        read_model_shape(hub)
    assert "not in the local Hugging Face cache" in str(err.value)
    assert "--model-config" in str(err.value)
    snapshot = tmp_path / "hub" / "models--Org--Model-1B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(_config(5)))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    assert read_model_shape(hub).layers == 5
    assert read_model_shape(hub, folder / "config.json").layers == 3


@pytest.mark.parametrize(
    ("config", "wanted"),
    [
        ({"hidden_size": 64}, "num_hidden_layers (None) must be a positive integer"),
        ({**_config(2), "hidden_size": "64"}, "hidden_size ('64') must be a positive integer"),
        ({**_config(2), "num_experts": 8}, "mixture-of-experts"),
    ],
)
def test_a_config_it_cannot_estimate_is_named(config: dict, wanted: str):
    with pytest.raises(ConfigError) as err:
        shape_from_config(config, "m/config.json")
    assert wanted in str(err.value) and "m/config.json" in str(err.value)


def _pbt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pbt.cli", *args], capture_output=True, text=True, timeout=120
    )


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_command_prints_the_table_and_the_fit(tmp_path: Path):
    manifest = _write(tmp_path / "m.yaml", small_sections(tmp_path))
    fits = _pbt("estimate-memory", str(manifest), "--prompt-tokens", "50")
    assert fits.returncode == 0, fits.stderr
    for text in ("base weights", "activations", "KV cache", "peak per rank", "50 prompt"):
        assert text in fits.stdout, text
    assert "fits: 0.5" in fits.stdout and "a 140 GiB GPU" in fits.stdout
    tight = _pbt("estimate-memory", str(manifest), "--gpu-gib", "0.51")
    assert tight.returncode == 0, tight.stderr
    assert "does not fit" in tight.stdout
    assert "algorithm.micro_batch_size: 2" in tight.stdout  # names the knob that fits


def test_bad_input_is_one_line_without_a_traceback(tmp_path: Path):
    manifest = _write(tmp_path / "m.yaml", small_sections(tmp_path))
    negative = _pbt("estimate-memory", str(manifest), "--gpu-gib", "-3")
    assert negative.returncode == 2
    assert "--gpu-gib ('-3') must be a number > 0; give the GPU's memory in GiB" in negative.stderr
    hub = _write(tmp_path / "hub.yaml", {**small_sections(tmp_path), "model": {"name": "Org/M"}})
    uncached = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "estimate-memory", str(hub)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty")},
    )  # fmt: skip
    assert uncached.returncode == 2
    assert (
        "model.name ('Org/M') is a hub id whose config.json is not in the local" in uncached.stderr
    )
    knobs = {"activation_checkpointing": "yes", "activation_ofloading": True}
    typo = _write(tmp_path / "typo.yaml", {**small_sections(tmp_path), "training": knobs})
    misspelt = _pbt("estimate-memory", str(typo))
    assert misspelt.returncode == 2
    for text in (
        "training.activation_checkpointing ('yes') must be true or false",
        "training.activation_ofloading is not a known key; did you mean 'activation_offloading'?",
    ):
        assert text in misspelt.stderr, misspelt.stderr
    assert "Traceback" not in negative.stderr + uncached.stderr + misspelt.stderr


def test_check_warns_when_members_would_not_fit(tmp_path: Path):
    folder = tmp_path / "big"
    folder.mkdir()
    big = {
        **_config(64),
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
    }  # fmt: skip  (a 32B shape)
    (folder / "config.json").write_text(json.dumps(big))
    sections = small_sections(tmp_path)
    sections["model"] = {"name": "big"}
    sections["algorithm"] = {"group_size": 8, "prompts_per_step": 8}
    sections["rollout"] = {"max_output_tokens": 2048}
    on_gpu = {**sections, "launch": {"gpus_per_member": 1}}
    checked = _pbt("check", str(_write(tmp_path / "gpu.yaml", on_gpu)))
    assert checked.returncode == 0, checked.stderr
    assert "warning: members need an estimated" in checked.stderr
    assert "more than an H200's 140 GiB" in checked.stderr
    assert "set algorithm.micro_batch_size: 1" in checked.stderr  # the first knob that fits
    assert "details: pbt estimate-memory" in checked.stderr
    on_cpu = _pbt("check", str(_write(tmp_path / "cpu.yaml", sections)))
    assert on_cpu.returncode == 0 and "warning" not in on_cpu.stderr


def test_the_constants_mirror_the_code_they_describe():
    from pbt.algorithms.rollout import hf, static
    from pbt.algorithms.runtime import activations

    assert memory.LOGIT_CHUNK_BYTES == hf.LOGIT_CHUNK_BYTES
    assert memory.STATIC_LENGTH_BUCKET == static.LENGTH_BUCKET
    assert memory.OFFLOAD_PREFETCH_BYTES == activations.PREFETCH_BYTES
