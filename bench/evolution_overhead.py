"""Evolution overhead: the share of wall time not spent in rollouts and optimizer steps, with
long-lived workers against a process (and a model load) per member task, side by side.

    python bench/evolution_overhead.py                              # CPU, the tiny model
    python bench/evolution_overhead.py --shape 0.5b --device cuda --members 8 --steps 20

Two generations of ``--members`` member tasks through the campaign's own launchers and worker
(the controller's bookkeeping, a few milliseconds a generation, is left out): generation 0
trains every member from the base model; in generation 1 each member loads a parent's
checkpoint (the next member's, as selection would pick) with its lr mutated. One slot, so tasks
run one after another. "Productive" is the time the workers report for training steps and
evaluation; the rest of the wall time (process start, imports, model load, checkpoint load and
save, handing tasks over) is the overhead. "Generation 1 alone" is the same share for the second
generation only: what every generation after the first costs once a long-lived worker holds
the model (a long campaign's steady state).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", default="hf", choices=["hf", "static"])
    args = parser.parse_args()

    from pbt.launch import (
        LocalLauncher,
        PersistentLauncher,
        TaskSpec,
        member_command,
        write_json_atomic,
    )

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = "builtin:tiny"
        if args.shape != "tiny":
            from pbt.algorithms.tiny import build_shaped_model

            model = str(build_shaped_model(root / "model", **SHAPES[args.shape]))
        manifest = {
            "model": {"name": model},
            "algorithm": {"group_size": 8, "prompts_per_step": 8},
            "rollout": {"max_output_tokens": 32, "engine": args.engine},
            "task": {"name": "builtin:letters", "eval_size": 32},
            "training": {"device": args.device, "steps": 2 * args.steps, "seed": 0},
        }
        command = member_command()
        gpus = 1 if args.device == "cuda" else 0
        env = {} if gpus else {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}
        rows = {}
        for mode in ("long-lived worker", "restart per task"):
            campaign = root / mode.replace(" ", "-")
            common = dict(slots=1, gpus_per_member=gpus, heartbeat_timeout_s=600.0, env=env)
            if mode == "long-lived worker":
                launcher = PersistentLauncher(command, campaign / "workers", **common)
            else:
                launcher = LocalLauncher(command, **common)
            walls, works, fitness = [], [], []
            try:
                for generation in (0, 1):
                    tasks = []
                    for i in range(args.members):
                        member = f"g{generation}-m{i}"
                        parent = f"g0-m{(i + 1) % args.members}" if generation else None
                        task_dir = campaign / "tasks" / member
                        task_dir.mkdir(parents=True)
                        write_json_atomic(
                            task_dir / "task.json",
                            {
                                "campaign_dir": str(campaign),
                                "manifest": manifest,
                                "manifest_base_dir": str(root),
                                "member_id": member,
                                "generation": generation,
                                "parent_id": parent,
                                "parent_checkpoint": f"checkpoints/{parent}" if parent else None,
                                "hyperparameters": {"lr": 5e-3 * (0.8 + 0.1 * i)},
                                "mutation": "lr" if parent else None,
                                "steps": args.steps,
                                "checkpoint": f"checkpoints/{member}",
                            },
                        )
                        tasks.append(TaskSpec(member, task_dir, campaign / "logs" / member))
                    start = time.perf_counter()
                    outcomes = launcher.run(tasks)
                    walls.append(time.perf_counter() - start)
                    works.append(0.0)
                    for outcome in outcomes:
                        if outcome.status != "ok":
                            raise SystemExit(f"{mode}: {outcome.task_id} {outcome.detail}")
                        works[-1] += outcome.result["seconds"]
                        fitness.append(outcome.result["fitness"])
                    print(
                        f"{mode}, generation {generation}: wall {walls[-1]:.1f} s, productive "
                        f"{works[-1]:.1f} s",
                        flush=True,
                    )
            finally:
                launcher.close()
            rows[mode] = (sum(walls), sum(works), fitness, walls[1] - works[1], walls[1])

    restart, persistent = rows["restart per task"], rows["long-lived worker"]
    print(
        f"\n{args.shape} model on {args.device}: 2 generations x {args.members} members x "
        f"{args.steps} steps, one slot\n"
    )
    print(
        "| members run by | wall s | productive s | overhead s | overhead share | "
        "generation 1 alone: overhead share |"
    )
    print("|---|---|---|---|---|---|")
    for mode, (wall, productive, _, overhead_1, wall_1) in rows.items():
        print(
            f"| {mode} | {wall:.1f} | {productive:.1f} | {wall - productive:.1f} | "
            f"**{(wall - productive) / wall:.1%}** | {overhead_1 / wall_1:.1%} |"
        )
    ratio = (restart[0] - restart[1]) / max(persistent[0] - persistent[1], 1e-9)
    print(f"\noverhead, restart / long-lived: {ratio:.1f}x")
    print(f"same fitness in both modes: {restart[2] == persistent[2]}")


if __name__ == "__main__":
    main()
