"""Every algorithm of the family on the tiny model: 12 steps each, held-out fitness before and
after (a functional check of each learner on a device, not a speed benchmark).

    python bench/algorithms_check.py --device cuda
"""

from __future__ import annotations

import argparse
import time

import torch

from pbt.algorithms.runtime.member import Member
from pbt.config.read.loader import manifest_from_dict

VARIANTS = {
    "grpo": {"loss": "grpo"},
    "dr_grpo": {"loss": "dr_grpo"},
    "dapo": {"loss": "dapo", "clip_high": 0.28, "dynamic_sampling": True, "overlong_buffer": 4},
    "cispo": {"loss": "cispo"},
    "gspo": {"loss": "gspo"},
    "rloo": {"name": "REINFORCE", "baseline": "rloo"},
    "ppo": {"name": "PPO", "vf_coef": 1.0},
    "sft": {"name": "SFT"},
    "dpo": {"name": "DPO", "beta": 0.1},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(f"{'variant':8s} {'fitness':>26s} {'seconds':>8s} {'peak GiB':>9s}")
    for name, algorithm in VARIANTS.items():
        data = {
            "algorithm": {"group_size": 8, "prompts_per_step": 8, **algorithm},
            "optim": {"lr": 5e-3},
            "rollout": {"max_output_tokens": 12},
            "task": {"eval_size": 32},
            "training": {"device": args.device},
        }
        member = Member(manifest_from_dict(data), torch.device(args.device))
        task, learner = member.task, member.learner
        started = time.perf_counter()
        before = learner.evaluate(task.eval, task.reward)
        for _ in range(args.steps):
            metrics = learner.train_step(task.train, task.reward)
        after = learner.evaluate(task.eval, task.reward)
        seconds = time.perf_counter() - started
        peak = metrics.get("gpu_memory_gib", 0.0)
        print(f"{name:8s} {before:12.3f} -> {after:9.3f} {seconds:8.1f} {peak:9.3f}", flush=True)


if __name__ == "__main__":
    main()
