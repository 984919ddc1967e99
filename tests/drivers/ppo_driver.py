"""Run under torchrun by tests/unit/algorithms/test_ppo.py: a PPO member of 2 ranks, FSDP2-sharded or data
parallel, trains 2 steps, evaluates and saves to OUT/ppo; each rank writes what it saw to
OUT/rank<k>.json.

    ppo_driver.py OUT fsdp|dp
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import PPO_ALGORITHM, small_sections

from pbt.algorithms.runtime.member import Member
from pbt.config.read.loader import manifest_from_dict
from pbt.distributed import shutdown, world_info
from pbt.distributed.state import full_tensor

REPORTED = ("loss", "policy_loss", "value_loss", "kl", "clip_fraction", "explained_variance")


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    data = small_sections(out, algorithm=PPO_ALGORITHM)
    data["distributed"] = {"fsdp": mode == "fsdp"}
    member = Member(manifest_from_dict(data, base_dir=out), torch.device("cpu"), "ppo")
    task, learner = member.task, member.learner
    metrics = []
    for _ in range(2):
        step = learner.train_step(task.train, task.reward)
        metrics.append({key: step[key] for key in REPORTED})
    fitness = learner.evaluate(task.eval, task.reward)
    member.save(out / "ppo")
    report = {
        "metrics": metrics,
        "fitness": fitness,
        "sharded": any(type(p).__name__ == "DTensor" for p in member.model.parameters()),
        "value_head": full_tensor(member.model.value_head.weight).tolist(),
    }
    (out / f"rank{world_info().rank}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
