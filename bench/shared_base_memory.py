"""Memory of a population on one shared base model against one model per member, side by side.

    python bench/shared_base_memory.py --members 4                     # CPU, a 13M-parameter model
    python bench/shared_base_memory.py --members 8 --shape 0.5b --device cuda
    python bench/shared_base_memory.py --members 4 --json              # the figures as JSON

Each mode runs in its own fresh process: it builds the population, trains every member one GRPO
step, and reports the memory it grew by (resident set size on CPU; peak allocated on CUDA):

- ``shared``: library mode, every member a by-value adapter on ONE frozen base model;
- ``separate``: the usual shape elsewhere, every member its own model (base + adapter).

The figure that matters is the ratio ``separate / shared`` and ``shared / one base model``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shapes import pick

SHAPES = pick("wide", "0.5b")


def _rss_bytes() -> int:
    """Resident set size, after handing freed heap pages back to the system."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_mode(mode: str, model_dir: str, members: int, device: str) -> dict:
    """Build ``members`` members in ``mode`` in THIS process, train each one step; the growth
    after the first member and after all of them."""
    import peft  # noqa: F401  (imported before the first reading: code is not the population)
    import torch
    from transformers import Qwen2ForCausalLM  # noqa: F401
    from transformers.utils import logging as hf_logging

    from pbt.algorithms.runtime.member import Member
    from pbt.config.read.loader import manifest_from_dict
    from pbt.library.create import create_population

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(2)
    sections = {
        "model": {"name": model_dir},
        "algorithm": {"group_size": 4, "prompts_per_step": 2},
        "rollout": {"max_output_tokens": 8},
        "task": {"eval_size": 4},
        "training": {"device": device},
    }
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    if mode == "shared":
        pop = create_population(config=sections, population_size=members)
        agents = list(pop)
        step = [agent.train_step for agent in agents]
    else:
        manifest = manifest_from_dict(sections)
        target = torch.device("cuda" if cuda else "cpu")
        team: list[Member] = []

        def make(i: int):
            team.append(Member(manifest, target, f"m{i}"))
            member = team[-1]
            return lambda: member.learner.train_step(member.task.train, member.task.reward)

        step = [lambda i=i: make(i)() for i in range(members)]
    step[0]()
    first = _reading(cuda) - before
    for train in step[1:]:
        train()
    grown = _reading(cuda) - before
    if mode == "shared":
        accounting = pop.memory_bytes()
        model = accounting["base"] + accounting["slot"]
    else:
        model = sum(p.numel() * p.element_size() for p in team[0].model.parameters())
    return {
        "mode": mode,
        "members": members,
        "first": first,
        "grown": grown,
        "per_further_member": (grown - first) / max(members - 1, 1),
        "model_bytes": model,
    }


def _reading(cuda: bool) -> int:
    import gc

    import torch

    gc.collect()
    return torch.cuda.max_memory_allocated() if cuda else _rss_bytes()


def measure(shape: str, members: int, device: str, model_dir: str | None = None) -> dict:
    """Both modes, each in a fresh process; returns their figures and the ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            from pbt.algorithms.builtin.tiny import build_shaped_model

            model_dir = str(build_shaped_model(Path(tmp) / shape, **SHAPES[shape]))
        results = {}
        for mode in ("shared", "separate"):
            out = subprocess.run(
                [
                    *(sys.executable, __file__, "--child", mode, "--model-dir", model_dir),
                    *("--members", str(members), "--device", device),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode:
                raise RuntimeError(f"{mode} run failed:\n{out.stderr[-3000:]}")
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    model = results["shared"]["model_bytes"]
    return {
        **results,
        "shared_over_model": results["shared"]["grown"] / model,
        "separate_over_model": results["separate"]["grown"] / model,
        "separate_over_shared": results["separate"]["grown"] / results["shared"]["grown"],
        "further_ratio": results["separate"]["per_further_member"]
        / max(results["shared"]["per_further_member"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--shape", choices=SHAPES, default="wide")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model-dir", help="an existing model folder instead of --shape")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    parser.add_argument("--child", choices=["shared", "separate"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args.model_dir, args.members, args.device)))
        return
    r = measure(args.shape, args.members, args.device, args.model_dir)
    if args.json:
        print(json.dumps(r))
        return
    mib = 2**20
    print(f"population of {args.members}, shape {args.shape}, device {args.device}")
    print(f"  one model (base + adapter): {r['shared']['model_bytes'] / mib:8.1f} MiB")
    for mode in ("shared", "separate"):
        m = r[mode]
        print(
            f"  {mode:9s} grown: {m['grown'] / mib:8.1f} MiB in all, {m['first'] / mib:8.1f} MiB "
            f"for the first member, {m['per_further_member'] / mib:7.2f} MiB per further member"
        )
    print(f"  shared / one model:   {r['shared_over_model']:.2f}x")
    print(f"  separate / one model: {r['separate_over_model']:.2f}x")
    print(f"  separate / shared:    {r['separate_over_shared']:.2f}x in all")
    print(f"  separate / shared:    {r['further_ratio']:.1f}x per further member")


if __name__ == "__main__":
    main()
