"""Rollout tokens/s: the static-cache decoder against Hugging Face ``generate``, side by side.

    python bench/rollout_speed.py                                  # CPU, a 13M-parameter model
    python bench/rollout_speed.py --shape 0.5b --device cuda --batch 256 --prompt 64 --tokens 256
    python bench/rollout_speed.py --model builtin:smollm2-135m-instruct  # the real model (fetched)

One process, one LoRA model (r 16 on every linear layer, random adapter weights so the adapter
matters), the same prompts (random token ids, left-padded to ``--prompt`` with real lengths
between three quarters of it and all of it) and the same lengths for every mode: every
completion runs to ``--tokens`` (end-of-sequence is suppressed), sampled at temperature 1.

- ``HF generate``: ``model.generate`` with its default dynamic cache (``rollout.engine: hf``);
- ``HF generate, static cache, compiled``: ``cache_implementation="static"``, with which
  ``generate`` compiles the decode forward itself (CUDA only);
- ``static, eager``: :mod:`pbt.algorithms.rollout.static` with ``cuda_graphs: false``;
- ``static + CUDA graphs``: the same, each decode step replayed as one graph
  (``rollout.engine: static``, the default ``cuda_graphs: true``; GPU only);
- ``static + CUDA graphs + compile``: the decode step compiled by ``torch.compile`` before
  it is captured (``rollout.compile: true``).

The static modes run as a member does by default on CUDA: under bf16 autocast over the
half-precision base (``training.mixed_precision``).

Each figure is the best of ``--repeats`` timed calls after ``--warmup`` warm-up calls (which
include compilation and graph capture). Then a greedy check: greedy completions of the
fastest static mode against greedy ``generate`` on the same prompts, rows identical (in
half precision near-ties can flip a token; ``--dtype float32`` shows the paths agree).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], help="modes to leave out, by key")
    args = parser.parse_args()

    import torch

    from pbt.algorithms.builtin.tiny import build_shaped_model
    from pbt.algorithms.rollout.static import Sampling, StaticDecoder
    from pbt.algorithms.runtime.models import add_lora, load_base_model, quiet_transformers
    from pbt.config import LoRAConfig, ModelConfig

    quiet_transformers()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.model:
        base = load_base_model(ModelConfig(name=args.model, dtype=args.dtype), device)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            folder = build_shaped_model(Path(tmp) / args.shape, **SHAPES[args.shape])
            base = load_base_model(ModelConfig(name=str(folder), dtype=args.dtype), device)
    label = args.model or f"{args.shape} shape"
    model = add_lora(base, LoRAConfig(r=16, alpha=32))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.eval()
    config = base.config
    pad_id, eos_id = 0, config.eos_token_id if config.eos_token_id is not None else 1
    n, width = args.batch, args.prompt
    lengths = torch.randint(width * 3 // 4, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    ids = torch.randint(2, config.vocab_size, (n, width), generator=gen).masked_fill(
        mask == 0, pad_id
    )
    ids, mask = ids.to(device), mask.to(device)
    dtype = next(base.parameters()).dtype
    print(
        f"{label} ({sum(p.numel() for p in base.parameters()) / 1e6:.0f}M parameters, "
        f"{dtype}), LoRA r 16, batch {n}, prompt {width}, {args.tokens} new tokens, {device}"
    )

    def hf(static: bool = False, greedy: bool = False):
        extra = {"cache_implementation": "static"} if static else {}
        sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.tokens,
            min_new_tokens=0 if greedy else args.tokens,
            do_sample=not greedy,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
            **sampling,
            **extra,
        )
        return out[:, width:]

    variants = [(False, False), (True, False), (True, True)] if cuda else [(False, False)]
    decoders = {
        (graphs, compile): StaticDecoder(
            model, pad_id=pad_id, eos_id=eos_id, cuda_graphs=graphs, compile=compile
        )
        for graphs, compile in variants
    }
    # the product's default on CUDA: bf16 autocast over a half-precision base
    autocast = dtype if cuda and dtype != torch.float32 else None

    def static(graphs: bool, compile: bool = False, greedy: bool = False):
        return decoders[graphs, compile].generate(
            ids,
            mask,
            max_new_tokens=args.tokens,
            min_new_tokens=0 if greedy else args.tokens,
            sampling=Sampling(greedy=greedy),
            autocast_dtype=autocast,
        )

    modes = {"hf": ("HF generate", hf)}
    if cuda:
        modes["hf-static"] = ("HF generate, static cache, compiled", lambda: hf(static=True))
    modes["static-eager"] = ("static, eager", lambda: static(False))
    if cuda:
        modes["static-graphs"] = ("static + CUDA graphs", lambda: static(True))
        modes["static-compiled"] = (
            "static + CUDA graphs + compile",
            lambda: static(True, compile=True),
        )

    results = {}
    for key, (label, run) in modes.items():
        if key in args.skip:
            continue
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.warmup):
            out = run()
        warm = time.perf_counter() - start
        best = float("inf")
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = run()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        assert out.shape == (n, args.tokens), (key, tuple(out.shape))
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        results[key] = (label, n * args.tokens / best, warm, peak)
        print(f"  {label}: {n * args.tokens / best:,.0f} tok/s (warm-up {warm:.1f} s)", flush=True)

    base_rate = results["hf"][1] if "hf" in results else None
    print()
    print("| mode | tok/s | x HF generate | x HF compiled static | warm-up s | peak GiB |")
    print("|---|---|---|---|---|---|")
    compiled = results.get("hf-static", (None, None))[1]
    for label, rate, warm, peak in results.values():
        vs_hf = f"{rate / base_rate:.2f}" if base_rate else "-"
        vs_compiled = f"{rate / compiled:.2f}" if compiled else "-"
        print(f"| {label} | {rate:,.0f} | {vs_hf} | {vs_compiled} | {warm:.1f} | {peak:.1f} |")

    fastest = max((key for key in results if key.startswith("static")), key=lambda k: results[k][1])
    graphs, compile = {"static-eager": (False, False), "static-graphs": (True, False)}.get(
        fastest, (True, True)
    )
    want = hf(greedy=True)
    got = static(graphs, compile, greedy=True)
    width_out = min(want.shape[1], got.shape[1])
    same = (want[:, :width_out] == got[:, :width_out]).all(dim=1)
    agree = (want[:, :width_out] == got[:, :width_out]).float().cumprod(dim=1).sum(dim=1)
    print(
        f"\ngreedy check ({results[fastest][0]} vs generate): "
        f"{int(same.sum())}/{n} rows identical over {width_out} tokens; "
        f"mean tokens before the first difference {float(agree.mean()):.1f}"
    )


if __name__ == "__main__":
    main()
