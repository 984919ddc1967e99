"""Train-step tokens/s and peak memory: the lean log-prob path against the naive peft loop.

    python bench/train_step.py                                     # CPU, a 13M-parameter model
    python bench/train_step.py --shape 0.5b --device cuda --batch 16 --prompt 64 --completion 448
    python bench/train_step.py --model builtin:smollm2-135m-instruct   # the real model (fetched)

Both run in one process on the same LoRA model (r 16 on every linear layer) and the same batch
(random tokens, every completion token real), one policy-gradient step each: forward, the
per-token log-probs of the completion, ``-(logp * advantage)`` averaged over tokens, backward,
AdamW step.

- ``naive``: ``model(...).logits`` for every position, then ``log_softmax`` in float32 over the
  vocabulary (what a plain peft loop does; the float32 logits dominate memory);
- ``lean``: :func:`pbt.algorithms.rollout.hf.sequence_logprobs`: logits only for the completion,
  in chunks of about 512 MiB of float32 reduced at once to the target's log-prob and recomputed
  in the backward pass; padding columns trimmed first;
- ``+ mixed precision``: the same under bf16 autocast (``training.mixed_precision``, the
  default on CUDA): the adapter keeps float32 master weights, every matmul runs in bf16;
- ``+ compile``: the decoder compiled too (``training.compile``), the output layer's logits
  recomputed in the backward pass;
- ``+ the head's gradient in forward``: a frozen output layer's gradient formed beside its
  log-probs (``GRADIENT_IN_FORWARD``), its elementwise work eager;
- ``+ the head's elementwise work compiled``: the same with the softmax's elementwise work
  compiled, as a compiled member runs it (``training.compile``).
- ``+ liger``: liger-kernel's fused linear GRPO loss (``LigerFusedLinearGRPOLoss``, token-mean,
  no KL, the ratio at 1 as in the other modes) in place of the lean log-probs and the loss, on
  the compiled decoder's hidden states: the well-kept kernel library's answer to the same
  step. Skipped (with a line saying so) where liger-kernel is not installed or cannot run (it
  needs Triton on a GPU).

Each figure is the mean of ``--steps`` steps after 3 warm-up steps; peak memory is the CUDA
allocator's peak over those steps (on CPU, not measured).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import pick

SHAPES = pick("wide", "0.5b", "1.5b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="wide", choices=list(SHAPES))
    parser.add_argument(
        "--model",
        help="a real model instead of --shape: a model.name (a folder, a .gguf file, or "
        "builtin:smollm2-135m-instruct after `python bench/real_model.py fetch`)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import torch

    from pbt.algorithms.builtin.tiny import build_shaped_model
    from pbt.algorithms.losses import token_logprobs
    from pbt.algorithms.rollout import hf
    from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
    from pbt.algorithms.runtime.models import (
        add_lora,
        compile_decoder,
        load_base_model,
        quiet_transformers,
        set_mixed_precision,
    )
    from pbt.config import LoRAConfig, ModelConfig

    quiet_transformers()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.model:
        base = load_base_model(ModelConfig(name=args.model), device)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_shaped_model(Path(tmp) / args.shape, **SHAPES[args.shape])
            base = load_base_model(ModelConfig(name=str(folder)), device)
    label = args.model or f"{args.shape} shape"
    model = add_lora(base, LoRAConfig(r=16, alpha=32))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    n, p_len, c_len = args.batch, args.prompt, args.completion
    batch = RolloutBatch(
        torch.randint(vocab, (n, p_len), generator=gen).to(device),
        torch.ones((n, p_len), dtype=torch.long, device=device),
        torch.randint(vocab, (n, c_len), generator=gen).to(device),
        torch.ones((n, c_len), device=device),
        [""] * n,
    )
    advantages = torch.randn((n, 1), generator=gen).to(device)

    def naive() -> torch.Tensor:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        attention = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1)
        logits = model(input_ids=ids, attention_mask=attention).logits
        return token_logprobs(logits[:, p_len - 1 : -1], batch.completion_ids, 1.0)

    def lean() -> torch.Tensor:
        return sequence_logprobs(model, batch, 1.0)

    def step(logprobs) -> None:
        logp = logprobs()
        loss = -(logp * advantages * batch.completion_mask).sum() / batch.completion_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    with torch.no_grad():  # the two paths compute the same log-probs
        gap = float((naive() - lean()).abs().max())
    results = {}

    def mixed() -> None:
        set_mixed_precision(model, True)

    def compiled() -> None:
        compile_decoder(model)
        model.pbt_compiled = False  # the head's elementwise work eager, until its own mode

    def fused() -> None:  # the head's elementwise work compiled, as a compiled member runs it
        model.pbt_compiled = True

    def recomputed() -> None:  # the frozen head's logits recomputed in backward
        hf.GRADIENT_IN_FORWARD = False

    def in_forward() -> None:  # the frozen head's gradient formed beside its log-probs
        hf.GRADIENT_IN_FORWARD = True

    modes = [
        ("naive peft loop", naive, None),
        ("lean log-probs", lean, recomputed),
        ("lean + mixed precision", lean, mixed),
        ("lean + mixed precision + compile", lean, compiled),
        ("lean + mixed precision + compile + the head's gradient in forward", lean, in_forward),
        ("... + the head's elementwise work compiled", lean, fused),
    ]
    liger = _liger_step(model, batch, advantages, optimizer, p_len) if cuda else None
    if liger is not None:
        modes.append(("liger fused linear GRPO + mixed precision + compile", None, None))
    else:
        print("liger-kernel: not installed or no GPU; its mode is skipped", flush=True)
    for name, fn, setup in modes:
        if setup is not None:
            setup()
        run = functools.partial(step, fn) if fn is not None else liger
        try:
            for _ in range(3):  # warm-up (and the compile)
                run()
        except Exception as err:  # a library mode that cannot run here is reported, not fatal
            if fn is not None:
                raise
            print(f"{name}: failed ({type(err).__name__}: {err}); skipped", flush=True)
            optimizer.zero_grad(set_to_none=True)
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            run()
        if cuda:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / args.steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        results[name] = (n * (p_len + c_len) / elapsed, peak)

    tok_naive, mem_naive = results["naive peft loop"]
    print(
        f"\n{label} on {args.device} ({base.dtype}), LoRA r 16 on every linear layer, "
        f"{n} x ({p_len} prompt + {c_len} completion) tokens, mean of {args.steps} steps"
    )
    print(f"largest |naive - lean| log-prob on this batch: {gap:.2e}\n")
    print("| step | tok/s | x naive | peak GiB | x naive |")
    print("|---|---|---|---|---|")
    for name, (tok, mem) in results.items():
        memory = f"{mem:.1f} | **{mem / mem_naive:.2f}x**" if cuda else "n/a | n/a"
        print(f"| {name} | {tok:,.0f} | **{tok / tok_naive:.2f}x** | {memory} |")


def _liger_step(model, batch, advantages, optimizer, p_len):
    """One step through liger-kernel's fused linear GRPO loss, or None without liger."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    import torch

    causal = model.get_base_model()
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo")
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = causal.model(input_ids=ids, attention_mask=attention).last_hidden_state
            loss, _ = loss_fn(
                hidden[:, p_len - 1 : -1], causal.lm_head.weight, batch.completion_ids,
                batch.completion_mask, advantages.squeeze(1),
            )  # fmt: skip
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


if __name__ == "__main__":
    main()
