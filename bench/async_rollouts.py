"""Asynchronous rollouts: tokens/s and held-out reward against wall time, for a colocated
(synchronous) member and members whose dedicated engine samples ahead with staleness 1, 2, 4.

    python bench/real_model.py fetch        # once: SmolLM2-135M-Instruct into the cache
    python bench/async_rollouts.py --device cuda --mps          # one GPU, trainer + engine
    python bench/async_rollouts.py --device cuda --engine-gpu   # two GPUs: engine on GPU 1
    python bench/async_rollouts.py --model builtin:tiny --device cpu --steps 4 --eval-every 2 \\
        --prompts 2 --group 4 --tokens 8 --eval-size 8 --task builtin:letters  # CPU dry run

The manifest is ``configs/examples/real_model/train.yaml`` (GRPO on 2-digit addition, the
static-cache engine) with the model, device, sizes and rollout settings of the command line.
Each mode runs in a process of its own (CUDA state never shared between modes); with
``--mps`` a private MPS daemon serves them, so the trainer and its engine process run their
kernels side by side on the one GPU; with ``--engine-gpu`` each engine runs on a GPU of its own
(the second visible one, as a launcher places a dedicated engine). A mode trains ``--steps`` steps in sessions of
``--eval-every`` (each session ends with the engine drained, as a generation boundary does)
and evaluates the held-out reward (greedy) after each; evaluation time is left out of the wall
time. Tokens/s counts sampled completion tokens over training wall time.

Modes: ``sync`` (the trainer samples itself), ``s0`` (a dedicated engine in lockstep: trains
exactly as sync, and shows what the process boundary costs), ``s1``, ``s2``, ``s4``
(``rollout.mode: async`` with that ``max_staleness``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "configs" / "examples" / "real_model" / "train.yaml"
MODES = {"sync": None, "s0": 0, "s1": 1, "s2": 2, "s4": 4}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16, help="algorithm.prompts_per_step")
    parser.add_argument("--group", type=int, default=8, help="algorithm.group_size")
    parser.add_argument("--tokens", type=int, default=48, help="rollout.max_output_tokens")
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--engine", default=None, help="rollout.engine (default: manifest's)")
    parser.add_argument("--task", default=None, help="task.name (default: builtin:addition)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mps", action="store_true", help="run the modes under a private MPS")
    parser.add_argument(
        "--engine-gpu", action="store_true", help="each engine on a GPU of its own (needs two)"
    )
    parser.add_argument("--out", default=None, help="JSON file (default bench/results/...)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def manifest_for(args: argparse.Namespace, mode: str):
    """The benchmark's manifest for ``mode``."""
    import yaml

    from pbt.config.read.loader import manifest_from_dict

    data = yaml.safe_load(MANIFEST.read_text())
    data["model"]["name"] = args.model
    data["algorithm"].update(group_size=args.group, prompts_per_step=args.prompts)
    data["rollout"]["max_output_tokens"] = args.tokens
    if args.engine:
        data["rollout"]["engine"] = args.engine
    data["task"]["eval_size"] = args.eval_size
    if args.task:
        data["task"]["name"] = args.task
    data["training"].update(device=args.device, seed=args.seed, steps=args.steps)
    staleness = MODES[mode]
    if staleness is not None:
        data["rollout"].update(mode="async", max_staleness=staleness)
        data["launch"] = {"rollout_gpus_per_member": 1}
    return manifest_from_dict(data, base_dir=MANIFEST.parent)


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    """Train one mode in this process; its record."""
    import torch

    from pbt.algorithms.runtime.member import Member

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    member = Member(manifest_for(args, mode), device)
    task, learner = member.task, member.learner
    member.train(0)  # starts the engine process (if any) before the clock
    curve = [{"step": 0, "wall_s": 0.0, "held_out": learner.evaluate(task.eval, task.reward)}]
    wall, tokens, steps, metrics = 0.0, 0.0, [], []
    while len(metrics) < args.steps:
        start = time.perf_counter()
        history = member.train(min(args.eval_every, args.steps - len(metrics)))
        _sync(device)
        wall += time.perf_counter() - start
        metrics += history
        tokens += sum(h["completion_length"] * args.prompts * args.group for h in history)
        reward = learner.evaluate(task.eval, task.reward)
        curve.append({"step": len(metrics), "wall_s": wall, "held_out": reward})
        steps.append(len(metrics))
    engine = member.host.rollout_engine
    if engine is not None:
        engine.close()
    return {
        "mode": mode,
        "engine_device": None if engine is None else engine.device,
        "max_staleness": MODES[mode],
        "train_wall_s": wall,
        "tokens_per_s": tokens / max(wall, 1e-9),
        "curve": curve,
        "stale_dropped": sum(h.get("stale_dropped", 0.0) for h in metrics),
        "mean_staleness": _mean([h.get("rollout_staleness", 0.0) for h in metrics]),
        "mean_wait_s": _mean([h.get("rollout_wait_s", 0.0) for h in metrics]),
        "is_weight_mean": _mean([h["is_weight_mean"] for h in metrics if h.get("is_weight_mean")]),
    }


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def table(records: list[dict]) -> str:
    """The records as a markdown table (held-out reward at each evaluation)."""
    lines = [
        "| mode | engine on | train wall s | tokens/s | speed-up | held-out by step | "
        "dropped rows | mean staleness | trainer wait s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r["tokens_per_s"] for r in records if r["mode"] == "sync"), None)
    for r in records:
        curve = ", ".join(f"{p['step']}: {p['held_out']:.3f}" for p in r["curve"])
        speed = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['mode']} | {r.get('engine_device') or '-'} | {r['train_wall_s']:.1f} | {r['tokens_per_s']:.0f} | {speed} | "
            f"{curve} | {r['stale_dropped']:.0f} | {r['mean_staleness']:.2f} | "
            f"{r['mean_wait_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.one:
        print("RECORD " + json.dumps(run_mode(args, args.one)), flush=True)
        return 0
    env = dict(os.environ)
    if args.engine_gpu:
        from pbt.protocol.engines import PLACEMENT_ENV, EnginePlacement

        env[PLACEMENT_ENV] = EnginePlacement("dedicated", 1).to_env()  # cuda:1, after cuda:0
    daemon = None
    if args.mps and args.device == "cuda":
        from pbt.launch.mps import MpsDaemon

        daemon = MpsDaemon().start()
        print(daemon.note, flush=True)
        env.update(daemon.env)
    records = []
    out = Path(args.out or ROOT / "bench" / "results" / f"async_rollouts_{args.device}.json")
    try:
        for mode in args.modes:
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
            proc = subprocess.run(
                [*cmd, "--one", mode], env=env, capture_output=True, text=True, check=False
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RECORD ")]
            if proc.returncode != 0 or not lines:
                print(f"{mode} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
                return 1
            records.append(json.loads(lines[-1][len("RECORD ") :]))
            print(table(records).splitlines()[-1], flush=True)  # each mode's row as it ends
            out.write_text(json.dumps({"args": vars(args), "records": records}, indent=1))
    finally:
        if daemon is not None:
            daemon.stop()
    print(table(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
