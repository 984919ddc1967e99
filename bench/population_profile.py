"""Where a population batch's time goes: the phases of a training step (rollout, scoring,
learning) and the evaluation, for ``--members`` members of one shared base trained one at a
time against trained together (their rollouts in one batch; with ``batched_train`` their
updates too), in one process, side by side.

    python bench/population_profile.py                                # CPU, the tiny model
    python bench/population_profile.py --shape 0.5b --device cuda --members 8 --steps 6

The workload is ``bench/population_fill.py``'s (8 prompts x 8 completions of up to 32 tokens a
step, the static engine, LoRA r 16 on every linear layer, eval on 32 held-out rows). Each mode
runs ``--steps`` steps to warm up (graphs captured, allocator settled), then ``--steps``
measured. A phase's seconds are wall time between its ends (the device is synchronised at
each, so the phases add up to the step); ``other`` is what the step spends outside them
(prompt sampling, step metrics, the adapter moved in and out of the slot). ``--trace`` adds
``torch.profiler``'s busiest operators for one measured step of each mode.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import pick

SHAPES = pick("wide", "0.5b", "smollm2-shape")
PHASES = ("rollout", "score", "learn", "other")
LEARN_PARTS = ("forward", "backward", "optimizer")
"""Parts of ``learn``: the log-prob forwards, the backward passes, the optimizer steps (with
clipping and the non-finite check); the rest of ``learn`` is the advantages and the loss."""


class Clock:
    """Seconds by phase, the device synchronised at each phase's end."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[phase] += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _manifest(model: str, args, batched_train: bool):  # population_fill's workload
    from pbt.config.read.loader import manifest_from_dict

    return manifest_from_dict(
        {
            "model": {"name": model},
            "algorithm": {"group_size": 8, "prompts_per_step": 8},
            "rollout": {"max_output_tokens": 32, "engine": args.engine},
            "task": {"name": "builtin:letters", "eval_size": 32},
            "training": {"device": args.device, "steps": 4 * args.steps, "seed": 0},
            "launch": {
                "members_per_batch": args.members,
                "batched_train": batched_train,
                "lora_kernel": args.kernel,
            },
        }
    )


def run_mode(model: str, args, mode: str) -> dict[str, float]:
    """One mode's measured seconds by phase, ``tokens`` and ``wall`` among them."""
    import torch

    from pbt.algorithms import grpo, passes
    from pbt.algorithms.learner import Learner
    from pbt.algorithms.runtime import population_train
    from pbt.algorithms.runtime.shared_base import SharedBase

    device = torch.device(args.device)
    shared = SharedBase(_manifest(model, args, mode.startswith("batched_train")), device)
    ids = [f"m{i}" for i in range(args.members)]
    for i, member_id in enumerate(ids):
        shared.add(member_id, 1000 + i)
    clock = Clock(device)
    tokens = [0.0]

    def count(original):
        def call(self, *a, **k):
            metrics = original(self, *a, **k)
            tokens[0] += metrics["completion_length"] * 64
            return metrics

        return call

    def train():
        if mode == "one at a time":
            for member_id in ids:
                shared.activate(member_id).train(args.steps)
        else:
            population_train.train_together(shared, ids, args.steps)

    def evaluate():  # batched modes: their greedy evaluations in one batch too
        if mode == "one at a time":
            for member_id in ids:
                member = shared.activate(member_id)
                member.learner.evaluate(member.task.eval, member.task.reward, 0.0)
        else:
            population_train.evaluate_together(shared, ids, 0.0)

    with contextlib.ExitStack() as stack:
        # alone: GRPO._rollout samples and scores; complete is its sampling part
        stack.enter_context(patched(grpo.GRPO, "complete", lambda f: clock.wrap("rollout", f)))
        stack.enter_context(patched(grpo.GRPO, "scored", lambda f: clock.wrap("score", f)))
        if mode == "one at a time":  # together, _learn below holds the members' learning
            stack.enter_context(patched(grpo.GRPO, "learn", lambda f: clock.wrap("learn", f)))
        stack.enter_context(patched(grpo.GRPO, "step_metrics", count))
        stack.enter_context(
            patched(population_train, "complete_together", lambda f: clock.wrap("rollout", f))
        )
        stack.enter_context(patched(population_train, "_learn", lambda f: clock.wrap("learn", f)))
        for owner, name, part in (
            (passes, "sequence_logprobs", "forward"),
            (population_train, "logprobs_together", "forward"),
            (torch.autograd, "backward", "backward"),
            (Learner, "_optimizer_step", "optimizer"),
        ):
            stack.enter_context(patched(owner, name, lambda f, p=part: clock.wrap(p, f)))
        train()  # warm-up
        clock.seconds.clear()
        tokens[0] = 0.0
        clock.sync()
        start = time.perf_counter()
        train()
        clock.sync()
        wall = time.perf_counter() - start
        measured = dict(clock.seconds)
        clock.sync()
        begin = time.perf_counter()
        evaluate()
        clock.sync()
        measured["evaluate"] = time.perf_counter() - begin
        if args.trace:
            title = f"{mode}: busiest operators over {args.steps} steps"
            trace(train, title, device.type == "cuda", args.trace)
    measured["other"] = wall - sum(measured.get(p, 0.0) for p in PHASES[:-1])
    measured |= {"wall": wall, "tokens": tokens[0]}
    shared.members.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def trace(run, title: str, cuda: bool, rows: int) -> None:
    """``torch.profiler``'s ``rows`` busiest operators (and, on a GPU, kernels, those inside
    replayed CUDA graphs too) over one call of ``run``, under ``title``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(f"\n{title}")
    print(prof.key_averages().table(sort_by=sort, row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--model", help="a model.name instead of --shape")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", default="static", choices=["hf", "static"])
    parser.add_argument(
        "--modes", nargs="+", default=["one at a time", "batched", "batched_train"],
        choices=["one at a time", "batched", "batched_train"],
    )  # fmt: skip
    parser.add_argument(
        "--kernel", default="auto", choices=["auto", "segmented", "stacked"],
        help="launch.lora_kernel of the batched modes",
    )  # fmt: skip
    parser.add_argument("--trace", type=int, default=0, help="operators to list (0: no trace)")
    args = parser.parse_args()

    from pbt.algorithms.runtime.models import quiet_transformers

    quiet_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or "builtin:tiny"
        if args.shape != "tiny" and not args.model:
            from pbt.algorithms.builtin.tiny import build_shaped_model

            model = str(build_shaped_model(Path(tmp) / "model", **SHAPES[args.shape]))
        rows = {}
        for mode in args.modes:
            rows[mode] = run_mode(model, args, mode)
            r = rows[mode]
            print(
                f"{mode}: wall {r['wall']:.2f} s, {r['tokens'] / r['wall']:,.0f} tok/s, "
                + ", ".join(f"{p} {r.get(p, 0.0):.2f} s" for p in (*PHASES, "evaluate"))
                + " (learn: "
                + ", ".join(f"{p} {r.get(p, 0.0):.2f} s" for p in LEARN_PARTS)
                + ")",
                flush=True,
            )
    name = args.model or args.shape
    print(
        f"\n{name} on {args.device}, engine {args.engine}: {args.members} members x {args.steps} "
        "steps (measured after as many to warm up), 8 x 8 completions of up to 32 tokens a step\n"
    )
    columns = (*PHASES, "evaluate", *LEARN_PARTS)
    print(
        "| mode | wall s | tok/s | x one at a time | "
        + " | ".join(columns[:5])
        + " | learn: "
        + " | ".join(columns[5:])
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(columns))
    base = rows.get("one at a time")
    for mode, r in rows.items():
        rate = r["tokens"] / r["wall"]
        ratio = "-" if base is None else f"{rate / (base['tokens'] / base['wall']):.2f}x"
        cells = " | ".join(f"{r.get(p, 0.0):.2f}" for p in columns)
        print(f"| {mode} | {r['wall']:.2f} | {rate:,.0f} | {ratio} | {cells} |")


if __name__ == "__main__":
    main()
