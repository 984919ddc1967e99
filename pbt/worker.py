"""Run one member task of a campaign: the program the launcher starts under torchrun.

    torchrun --nproc_per_node=N -m pbt.worker <task_dir>/task.json

The task (written by the controller) names the campaign's manifest, the member, its parent
checkpoint (or none: the base model), the hyperparameters, the steps to train and the seed. The
worker loads the parent checkpoint and only THEN applies the hyperparameters, so a mutated lr
lands in the optimizer's param groups with Adam's moments and the schedule's position kept. It
trains, evaluates, saves a gathered checkpoint and writes ``result.json`` (rank 0, atomically),
heartbeating all the while.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from pbt.errors import PbtError
from pbt.launch import Heartbeat, read_json, write_json_atomic
from pbt.manifest import manifest_from_dict
from pbt.population import member_seed


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """Train the member described by ``task`` and return its result (every rank calls this)."""
    import torch

    from pbt.algorithms.member import Member, seed_everything
    from pbt.distributed import pick_device, shutdown, world_info

    campaign = Path(task["campaign_dir"])
    manifest = manifest_from_dict(task["manifest"], base_dir=task["manifest_base_dir"])
    world = world_info()
    member = Member(
        manifest, pick_device(manifest.training.device, world.local_rank), task["member_id"]
    )
    try:
        if task["parent_checkpoint"]:
            member.load(campaign / task["parent_checkpoint"])
        member.learner.apply_hyperparameters(task["hyperparameters"])
        seed = member_seed(manifest.training.seed, task["member_id"])
        seed_everything(seed + world.rank)
        member.learner.generator.manual_seed(seed)
        member.lineage = {
            "member": task["member_id"],
            "parent": task["parent_id"],
            "generation": task["generation"],
            "mutation": task["mutation"],
        }
        started = time.perf_counter()
        history = _train(member, task["steps"])
        fitness = member.learner.evaluate(
            member.task.eval, member.task.reward_fn, manifest.training.eval_temperature
        )
        member.fitness.append(fitness)
        digest = member.save(campaign / task["checkpoint"])
        return {
            "status": "ok",
            "member_id": task["member_id"],
            "fitness": fitness,
            "metrics": history[-1] if history else {},
            "history": history,
            "steps": member.learner.step,
            "checkpoint": task["checkpoint"],
            "digest": digest,
            "seconds": time.perf_counter() - started,
            "world_size": world.world_size,
            "device": str(torch.device(member.device)),
        }
    finally:
        shutdown()


def _train(member, steps: int) -> list[dict[str, float]]:
    """Train ``steps`` steps; every step's metrics, with the lineage's step count."""
    learner, task = member.learner, member.task
    history = []
    for _ in range(steps):
        metrics = learner.train_step(task.train, task.reward_fn)
        history.append({"step": learner.step, **metrics})
        print(f"{member.member_id} step {learner.step} {learner.describe(metrics)}", flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m pbt.worker TASK_JSON``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pbt.worker TASK_JSON", file=sys.stderr)
        return 2
    task_path = Path(argv[0])
    task = read_json(task_path)
    if task is None:
        print(f"error: {task_path} is missing or not valid JSON", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", 0))
    with Heartbeat(task_path.parent / "heartbeat") if rank == 0 else contextlib.nullcontext():
        try:
            result = run_task(task)
        except PbtError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if rank == 0:
            write_json_atomic(task_path.parent / "result.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
