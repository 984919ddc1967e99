"""Run under torchrun by tests/unit/algorithms/test_algorithms.py: every algorithm as one member of 2 ranks.

For each variant: build the member (FSDP2-sharded, or data parallel) on all ranks, train 2
steps, evaluate, save a checkpoint to OUT/<variant>; each rank writes what it saw to
OUT/rank<k>.json.

    algorithms_driver.py OUT fsdp|dp
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import DATA_VARIANTS, RL_VARIANTS, small_sections

from pbt.algorithms.runtime.member import Member
from pbt.config.read.loader import manifest_from_dict
from pbt.distributed import shutdown, world_info


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    report = {}
    for name, variant in {**RL_VARIANTS, **DATA_VARIANTS}.items():
        data = small_sections(out)
        for section, values in variant.items():
            data[section] = {**data.get(section, {}), **values}
        data["distributed"] = {"fsdp": mode == "fsdp"}
        member = Member(manifest_from_dict(data, base_dir=out), torch.device("cpu"), name)
        task, learner = member.task, member.learner
        losses = [learner.train_step(task.train, task.reward)["loss"] for _ in range(2)]
        fitness = learner.evaluate(task.eval, task.reward)
        member.save(out / name)
        sharded = any(type(p).__name__ == "DTensor" for p in member.model.parameters())
        report[name] = {"losses": losses, "fitness": fitness, "sharded": sharded}
    (out / f"rank{world_info().rank}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
