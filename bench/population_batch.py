"""A population as one batch: population rollout tokens/s of ``--members`` members (LoRA r 16,
each its own random adapter) sampled one at a time against all of them in one batch with
per-row adapters, and the large-batch rate of the same rows through one adapter; per model,
side by side in one run.

    python bench/population_batch.py                                  # CPU, a small shape
    python bench/population_batch.py --device cuda --models 0.5b smollm2-shape \\
        --members 8 --rows 64 --prompt 64 --tokens 128

Modes (the static decoder of ``rollout.engine: static``; CUDA graphs on a GPU, under bf16
autocast over a bf16 base as a member runs by default; every row runs to ``--tokens``):

- ``one at a time``: the members in turn, ``--rows`` rows each, each member's adapter copied
  into the one adapter slot first (what a worker hosting several members does today);
- ``one batch, segmented`` / ``stacked``: :mod:`pbt.algorithms.rollout.batched`, all members'
  rows in one batch through :mod:`pbt.algorithms.runtime.lora_batch`'s kernels;
- ``large batch, one adapter``: the same number of rows through the plain decoder: the rate
  the batch would reach if every row had one adapter (the bound the batched modes approach).

``--train`` adds a train step's forward and backward (the completion log-probs of
``--completion`` tokens a row, the lean log-prob path, ``--micro`` rows of a member at a
time, as a train step takes them): the members in turn in the adapter
slot, against all rows in one pass with per-row adapters, as ``launch.batched_train`` runs it
(:func:`~pbt.algorithms.runtime.population_train.logprobs_together`: one forward, each
member's log-probs at its own temperature, one backward of their sum); its rows' ratios are to
the train step one at a time.

Then the tolerance check: each member's rows' first-token logits in the batch (segmented)
against its solo forward: the largest absolute difference over the logits' scale, and the
share of rows whose greedy first token is the same (float32: exact; bf16: near-ties flip).

``--models`` takes shape names (``0.5b``: Qwen2.5-0.5B's shape; ``smollm2-shape``:
SmolLM2-135M's shape as a random Qwen2; ``wide``: 13M) or a ``model.name`` such as
``builtin:smollm2-135m-instruct`` (after ``python bench/real_model.py fetch``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from population_profile import trace
from shapes import pick

SHAPES = pick("wide", "0.5b", "1.5b", "smollm2-shape")


def _load(name: str, device, dtype: str, tmp: Path):
    from pbt.algorithms.builtin.tiny import build_shaped_model
    from pbt.algorithms.runtime.models import load_base_model
    from pbt.config import ModelConfig

    if name in SHAPES:
        name = str(build_shaped_model(tmp / name, **SHAPES[name]))
    return load_base_model(ModelConfig(name=name, dtype=dtype), device)


def _timed(run, warmup: int, repeats: int, cuda: bool) -> tuple[float, float]:
    """(best seconds of ``repeats`` calls, seconds of the ``warmup`` calls)."""
    import torch

    start = time.perf_counter()
    for _ in range(warmup):
        run()
    warm = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, warm


def measure(name: str, args, device) -> dict:
    """Every mode's population tokens/s for one model, and the tolerance check."""
    import torch

    from pbt.algorithms.rollout.batched import BatchedDecoder, MemberRollout
    from pbt.algorithms.rollout.static import Sampling, StaticDecoder
    from pbt.algorithms.runtime.lora_batch import RowAdapters, segments_of
    from pbt.algorithms.runtime.models import add_lora
    from pbt.config import LoRAConfig, RolloutConfig

    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        base = _load(name, device, args.dtype, Path(tmp))
    model = add_lora(base, LoRAConfig(r=16, alpha=32)).eval()
    slot = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    adapters_by_member = [
        [torch.randn(p.shape, generator=gen).mul_(0.02).to(p) for p in slot]
        for _ in range(args.members)
    ]
    adapters = RowAdapters(model, args.members)
    for m, weights in enumerate(adapters_by_member):
        with torch.no_grad():
            for p, w in zip(slot, weights, strict=True):
                p.copy_(w)
        adapters.load_from_model(m)
    config = base.config
    pad_id, eos_id = 0, config.eos_token_id if config.eos_token_id is not None else 1
    n, width = args.members * args.rows, args.prompt
    lengths = torch.randint(width * 3 // 4, width + 1, (n,), generator=gen)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    ids = torch.randint(2, config.vocab_size, (n, width), generator=gen).masked_fill(
        mask == 0, pad_id
    )
    ids, mask = ids.to(device), mask.to(device)
    dtype = next(base.parameters()).dtype
    autocast = dtype if cuda and dtype != torch.float32 else None
    tokens = args.tokens
    sampling = Sampling(greedy=False)
    segments = segments_of([args.rows] * args.members)
    solo = StaticDecoder(model, pad_id=pad_id, eos_id=eos_id, cuda_graphs=True)
    batched = BatchedDecoder(model, pad_id=pad_id, eos_id=eos_id, cuda_graphs=True)
    cfg = RolloutConfig(engine="static", max_output_tokens=tokens, min_output_tokens=tokens)
    members = [
        MemberRollout(m, [], args.rows, torch.Generator(device=device).manual_seed(m))
        for m in range(args.members)
    ]

    def one_at_a_time():
        for m, s in enumerate(segments):
            with torch.no_grad():
                for p, w in zip(slot, adapters_by_member[m], strict=True):
                    p.copy_(w)
            solo.generate(
                ids[s.start : s.stop], mask[s.start : s.stop], max_new_tokens=tokens,
                min_new_tokens=tokens, sampling=sampling, autocast_dtype=autocast,
            )  # fmt: skip

    def one_batch(kernel: str):
        def run():
            with adapters.rows(segments, kernel):
                batched.generate_rows(
                    ids, mask, segments, members, cfg, kernel=kernel, autocast_dtype=autocast
                )

        return run

    def large_batch():
        solo.generate(
            ids, mask, max_new_tokens=tokens, min_new_tokens=tokens, sampling=sampling,
            autocast_dtype=autocast,
        )  # fmt: skip

    modes = {
        "one at a time": one_at_a_time,
        "one batch, segmented": one_batch("segmented"),
        "one batch, stacked": one_batch("stacked"),
        "large batch, one adapter": large_batch,
    }
    rates = {}
    for label, run in modes.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        best, warm = _timed(run, args.warmup, args.repeats, cuda)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        rates[label] = (n * tokens / best, warm, peak)
        print(
            f"  {name}, {label}: {n * tokens / best:,.0f} tok/s (warm-up {warm:.1f} s)", flush=True
        )
        if args.trace and label in ("one batch, stacked", "large batch, one adapter"):
            trace(run, f"{name}, {label}: busiest operators of one call", cuda, args.trace)
    check = _tolerance(model, adapters, slot, adapters_by_member, ids, mask, segments, autocast)
    if args.train:
        rates |= _train_modes(model, adapters, slot, adapters_by_member, ids, mask, segments, args)
    return {
        "rates": rates,
        "check": check,
        "dtype": dtype,
    }


def _train_modes(model, adapters, slot, weights, ids, mask, segments, args) -> dict:
    """Forward and backward of every row's completion log-probs (``--completion`` tokens a
    row): each member in turn over its rows in the adapter slot, against all members' rows in
    one pass with per-row adapters (each member's stacked adapter gets its gradient from its
    rows only)."""
    import torch

    from pbt.algorithms.passes import LogProbs
    from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
    from pbt.algorithms.runtime.models import set_mixed_precision
    from pbt.algorithms.runtime.population_train import logprobs_together

    cuda = ids.device.type == "cuda"
    set_mixed_precision(model, True)
    gen = torch.Generator().manual_seed(1)
    rows = ids.shape[0]
    completion = torch.randint(2, model.config.vocab_size, (rows, args.completion), generator=gen)
    completion_mask = torch.ones(completion.shape, dtype=torch.float32)
    batch = RolloutBatch(
        ids, mask, completion.to(ids.device), completion_mask.to(ids.device), [""] * rows
    )
    model.train()

    micro = args.micro or max(s.stop - s.start for s in segments)
    chunks = [  # each member's rows, a micro-batch at a time (as a train step takes them)
        [slice(a, min(a + micro, s.stop)) for a in range(s.start, s.stop, micro)] for s in segments
    ]

    def one_at_a_time():
        for m, member_chunks in enumerate(chunks):
            with torch.no_grad():
                for p, w in zip(slot, weights[m], strict=True):
                    p.copy_(w)
            for rows in member_chunks:
                sequence_logprobs(model, batch.select(rows), 1.0 + 0.1 * m).sum().backward()

    # what launch.batched_train runs: each member's micro-batch a log-prob request at its own
    # temperature, all members' answered by one forward, their losses' sum by one backward
    slots = {m: s.slot for m, s in enumerate(segments)}

    def one_pass():
        for c in range(max(len(x) for x in chunks)):
            asks = {
                m: LogProbs(batch.select(x[c]), 1.0 + 0.1 * m, grad=True)
                for m, x in enumerate(chunks)
                if c < len(x)
            }
            logp = logprobs_together(model, adapters, {m: slots[m] for m in asks}, asks)
            torch.stack([v.sum() for v in logp.values()]).sum().backward()

    out = {}
    tokens = rows * args.completion
    for t in adapters.a + adapters.b:
        t.requires_grad_(True)
    modes = (("train step, one at a time", one_at_a_time), ("train step, one pass", one_pass))
    for label, run in modes:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        best, warm = _timed(run, args.warmup, args.repeats, cuda)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        out[label] = (tokens / best, warm, peak)
        print(f"  {label}: {tokens / best:,.0f} tok/s", flush=True)
    for t in adapters.a + adapters.b:
        t.requires_grad_(False)
        t.grad = None
    model.eval()
    return out


def _tolerance(
    model, adapters, slot, weights, ids, mask, segments, autocast
) -> tuple[float, float]:
    """(largest |batched - solo| first-token logit over the logits' largest magnitude, share of
    rows with the same greedy first token)."""
    import contextlib

    import torch

    context = (
        torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    )
    with torch.no_grad(), context:
        with adapters.rows(segments, "segmented"):
            together = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
        alone = []
        for m, s in enumerate(segments):
            for p, w in zip(slot, weights[m], strict=True):
                p.copy_(w)
            rows = slice(s.start, s.stop)
            alone.append(
                model(input_ids=ids[rows], attention_mask=mask[rows]).logits[:, -1].float()
            )
    alone = torch.cat(alone)
    diff = float((together - alone).abs().max() / alone.abs().max())
    same = float((together.argmax(-1) == alone.argmax(-1)).float().mean())
    return diff, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["wide"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="rows a member samples a step")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--train", action="store_true",
        help="also time a train step's forward and backward, one at a time against one pass",
    )  # fmt: skip
    parser.add_argument(
        "--trace", type=int, default=0,
        help="operators (on a GPU, kernels) to list for one call of the stacked batch and of "
        "the large batch (0: no trace)",
    )  # fmt: skip
    parser.add_argument("--completion", type=int, default=64, help="tokens a row, --train")
    parser.add_argument(
        "--micro", type=int, default=8,
        help="rows a member's micro-batch, --train (0: all its rows at once)",
    )  # fmt: skip
    args = parser.parse_args()

    import torch

    from pbt.algorithms.runtime.models import quiet_transformers

    quiet_transformers()
    device = torch.device(args.device)
    results = {name: measure(name, args, device) for name in args.models}
    print(
        f"\n{args.members} members x {args.rows} rows, prompt {args.prompt}, {args.tokens} new "
        f"tokens each, LoRA r 16, static decoder on {device}\n"
    )
    print(
        "| model | mode | population tok/s | x one at a time | share of large batch | warm-up s | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, result in results.items():
        rates = result["rates"]
        one, large = rates["one at a time"][0], rates["large batch, one adapter"][0]
        for label, (rate, warm, peak) in rates.items():
            if label.startswith("train step"):  # its ratios: to the train step one at a time
                one = large = rates["train step, one at a time"][0]
            print(
                f"| {name} | {label} | {rate:,.0f} | **{rate / one:.2f}x** | {rate / large:.0%} | "
                f"{warm:.1f} | {peak:.1f} |"
            )
    print()
    for name, result in results.items():
        diff, same = result["check"]
        print(
            f"tolerance, {name} ({result['dtype']}): batched vs solo first-token logits differ by "
            f"at most {diff:.2e} of their largest magnitude; same greedy token in {same:.1%} of rows"
        )


if __name__ == "__main__":
    main()
