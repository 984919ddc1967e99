"""Activation checkpointing, activation offloading and QLoRA on the train step: peak memory,
tokens/s, exactness, and what ``pbt estimate-memory`` predicts for the same step.

    python bench/activation_memory.py                      # CPU, the "wide" 13M shape
    python bench/activation_memory.py --shape tiny --modes all   # CPU dry run of every mode
    python bench/activation_memory.py --shape 0.5b --device cuda --batch 16 --completion 448
    python bench/activation_memory.py --shape 7b --device cuda --batch 4 --completion 4032 \
        --modes all

Each mode builds the model afresh from the same seed (random weights of a Qwen2.5 shape, bf16 on
CUDA, LoRA r 16 on every projection, mixed precision) and takes policy-gradient steps on one
batch of random tokens (as ``bench/train_step.py``): the lean log-probs, ``-(logp *
advantage)`` averaged over tokens, backward, AdamW. Knobs: ``activation_checkpointing``,
``activation_offloading`` (its hooks run on the CPU too, host to host) and ``qlora`` (the
blocks' projections quantized in place by bitsandbytes, as ``model.quantization`` loads them:
nf4, bfloat16 compute and storage, double quantization). Modes: ``plain``, each knob alone,
and together (``both`` is the two activation knobs; ``qlora+...`` adds the 4-bit base);
``--modes all`` runs all eight. bitsandbytes is needed for the qlora modes only.

Printed per mode: tokens/s (mean of ``--steps`` after 2 warm-ups), the CUDA allocator's peak
over those steps, the estimate of :mod:`pbt.estimate.memory` for the same shape and batch,
the host bytes one forward offloads, and the largest difference of the second step's log-probs
and adapter gradients to the plain mode's (the first step's lora_A gradients are zero).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN2

SHAPES = QWEN2

MODES = {  # (checkpointing, offloading, qlora)
    "plain": (False, False, False),
    "activation_checkpointing": (True, False, False),
    "activation_offloading": (False, True, False),
    "both": (True, True, False),
    "qlora": (False, False, True),
    "qlora+activation_checkpointing": (True, False, True),
    "qlora+activation_offloading": (False, True, True),
    "qlora+both": (True, True, True),
}
QLORA = {"quant_type": "nf4", "compute_dtype": "bfloat16", "double_quant": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="wide", choices=list(SHAPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES)[:4], choices=[*MODES, "all"],
        help="which modes to run (default: plain and the activation knobs; all: every mode)",
    )  # fmt: skip
    parser.add_argument(
        "--snapshot", default=None, metavar="DIR",
        help="CUDA only: write each mode's allocator history over its timed steps to "
        "DIR/MODE.pickle (torch.cuda.memory._dump_snapshot; view at pytorch.org/memory_viz) "
        "to see what is allocated at the peak; recording slows the steps",
    )  # fmt: skip
    parser.add_argument(
        "--by-block", action="store_true",
        help="build the model on the meta device and give each block its storage, random "
        "weights and (qlora) its 4-bit layers in turn, so that no more than one block is ever "
        "held unquantized: how a base larger than the device in bf16 is built",
    )  # fmt: skip
    args = parser.parse_args()
    modes = list(MODES) if "all" in args.modes else args.modes
    if args.snapshot and args.device != "cuda":
        parser.error(f"--snapshot ({args.snapshot!r}) needs --device cuda; drop --snapshot on cpu")

    results = {name: run_or_oom(args, name) for name in modes}
    plain = results.get("plain")
    print(
        f"\n{args.shape} shape on {args.device}, LoRA r 16 on every projection, "
        f"{args.batch} x ({args.prompt} + {args.completion}) tokens, mean of {args.steps} steps"
        + ("" if args.device == "cuda" else "; peak memory is measured on CUDA only")
    )
    print(
        "\n| mode | tok/s | x plain | peak GiB | estimate GiB | offloaded GiB | max dlogp | max dgrad "
        "| held before the build GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if r.get("oom"):
            print(f"| {name} | out of memory | | | {r['estimate']:.3f} | | | | |")
            continue
        ratio = r["tok_s"] / plain["tok_s"] if plain else float("nan")
        gap_logp = (r["logp"] - plain["logp"]).abs().max().item() if plain else float("nan")
        gap_grad = max(
            ((r["grads"][k] - g).abs().max().item() for k, g in plain["grads"].items()), default=0.0
        ) if plain else float("nan")  # fmt: skip
        print(
            f"| {name} | {r['tok_s']:,.0f} | {ratio:.2f} | {r['peak']:.3f} | {r['estimate']:.3f} "
            f"| {r['offloaded']:.2f} | {gap_logp:.1e} | {gap_grad:.1e} | {r['before']:.3f} |"
        )


def run_or_oom(args: argparse.Namespace, name: str) -> dict:
    """:func:`run_mode`, or a row that says the mode ran out of device memory."""
    import gc

    import torch

    try:
        result = run_mode(args, *MODES[name], name=name)
        print(
            f"{name}: {result['tok_s']:,.0f} tok/s, peak {result['peak']:.3f} GiB "
            f"(allocated before the build {result['before']:.3f}), "
            f"estimate {result['estimate']:.3f} GiB",
            flush=True,
        )
        return result
    except torch.OutOfMemoryError as err:
        print(f"{name}: out of memory ({str(err).splitlines()[0]})", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return {"oom": True, "estimate": bench_estimate(model_config(args.shape), args, *MODES[name])}


def model_config(shape: str):
    """The Qwen2 config of ``shape``."""
    from transformers import Qwen2Config

    fields = {"vocab_size": 1024, "tie_word_embeddings": True, **SHAPES[shape]}
    return Qwen2Config(**{"max_position_embeddings": 8192} | fields)


def build_by_block(config, device, qlora: bool):
    """The base of ``config`` built on the meta device, then given storage block by block:
    random weights as transformers initialises them (normal, std ``initializer_range``; norms
    at one), each block quantized (``qlora``) before the next one is materialised."""
    import torch
    from transformers import AutoModelForCausalLM

    from pbt.algorithms.runtime.models import keep_cpu_layout, quantize_block
    from pbt.distributed.fsdp import transformer_blocks

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    base.requires_grad_(False)
    blocks = transformer_blocks(base)
    inside = {id(m) for block in blocks for m in block.modules()}

    def materialise(module) -> None:
        module.to_empty(device=device, recurse=False)
        for name, param in module.named_parameters(recurse=False):
            if name == "weight" and param.dim() == 1:  # a norm
                param.data.fill_(1.0)
            elif name == "bias":
                param.data.zero_()
            else:
                param.data.normal_(0.0, config.initializer_range)

    for block in blocks:
        for module in block.modules():
            materialise(module)
        if qlora:
            quantize_block(block, device, QLORA["quant_type"], QLORA["double_quant"])
    for module in base.modules():
        if id(module) not in inside:
            materialise(module)
    rotary = base.model.rotary_emb  # its frequencies are computed, not initialised
    with device:
        base.model.rotary_emb = type(rotary)(config=config)
    if qlora:
        keep_cpu_layout(base)
    left = [n for n, t in [*base.named_parameters(), *base.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"left on the meta device: {left[:5]}")
    return base


def run_mode(
    args: argparse.Namespace,
    checkpointing: bool,
    offloading: bool,
    qlora: bool = False,
    name: str = "mode",
) -> dict:
    """Build the model with the knobs and time ``args.steps`` training steps."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
    from pbt.algorithms.runtime.activations import ActivationOffload, checkpoint_blocks
    from pbt.algorithms.runtime.models import (
        add_lora,
        quantize_blocks,
        quiet_transformers,
        set_mixed_precision,
    )
    from pbt.config import LoRAConfig

    quiet_transformers()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    gc.collect()  # the modes before this one leave nothing behind that the peak would count
    if cuda:
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    torch.manual_seed(0)
    config = model_config(args.shape)
    if getattr(args, "by_block", False):
        base = build_by_block(config, device, qlora)
    else:
        with device:
            base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else None)
        base.requires_grad_(False)
        if qlora:
            quantize_blocks(base, device, QLORA["quant_type"], QLORA["double_quant"])
    model = add_lora(base, LoRAConfig(r=16, alpha=32))
    set_mixed_precision(model, True)
    if checkpointing:
        checkpoint_blocks(base)
    offload = None
    if offloading:
        offload = ActivationOffload(device)
        offload.install(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    n, p_len, c_len = args.batch, args.prompt, args.completion
    batch = RolloutBatch(
        torch.randint(config.vocab_size, (n, p_len), generator=gen).to(device),
        torch.ones((n, p_len), dtype=torch.long, device=device),
        torch.randint(config.vocab_size, (n, c_len), generator=gen).to(device),
        torch.ones((n, c_len), device=device),
        [""] * n,
    )
    advantages = torch.randn((n, 1), generator=gen).to(device)
    model.train()
    seen: dict = {}

    def step(record: bool = False) -> None:
        logp = sequence_logprobs(model, batch, 1.0)
        loss = -(logp * advantages).mean()
        loss.backward()
        if record:
            seen["logp"] = logp.detach().float().cpu()
            seen["grads"] = {
                n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None
            }
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step(record=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the build's unquantized weights are not counted
    snapshot = getattr(args, "snapshot", None)
    if snapshot:
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    if snapshot:
        Path(snapshot).mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(Path(snapshot) / f"{name}.pickle"))
        (Path(snapshot) / f"{name}.start").write_text(f"{start_bytes}\n")
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {
        "tok_s": n * (p_len + c_len) / elapsed,
        "peak": peak,
        "before": before,
        "estimate": bench_estimate(config, args, checkpointing, offloading, qlora),
        "offloaded": (offload.offloaded_bytes / 2**30) if offload else 0.0,
        **seen,
    }


def bench_estimate(
    config,
    args: argparse.Namespace,
    checkpointing: bool,
    offloading: bool,
    qlora: bool = False,
    in_forward: bool | None = None,
) -> float:
    """The estimate's training peak for this step (no rollout) on CUDA, in GiB: bf16 weights,
    mixed precision, LoRA r 16 on every projection, ``args.batch`` sequences a forward; the
    output layer's gradient formed in the forward pass or not (``in_forward``; by default as
    the code runs it)."""
    from pbt.algorithms.rollout import hf
    from pbt.estimate.memory import GIB, Plan, estimate
    from pbt.estimate.model_shape import shape_from_config

    if in_forward is None:
        in_forward = hf.GRADIENT_IN_FORWARD

    shape = shape_from_config(config.to_dict(), args.shape)
    plan = Plan(
        micro_batch=args.batch,
        prompt_tokens=args.prompt,
        completion_tokens=args.completion,
        lora_r=16,
        checkpointing=checkpointing,
        offloading=offloading,
        quantized=qlora,
        double_quant=QLORA["double_quant"],
        generic_lora_on_4bit=True,  # quantize_blocks: peft's generic layer, not its 4-bit one
        head_gradient_in_forward=in_forward,
    )
    return estimate(shape, plan).peak / GIB


if __name__ == "__main__":
    main()
