"""Run under torchrun (2 ranks, gloo) by tests/integration/test_multiturn.py: a member that
plays a multi-turn environment on each rank (data parallel).

The environment (OUT/echo_env.py, written here) records every ``reset`` seed in a file of its
rank's own, so the test sees which episodes each rank played. Each rank trains two steps
(through :meth:`Member.train`, as ``pbt train`` does), evaluates, saves the checkpoint to
OUT/ckpt (a collective; rank 0 writes) and writes what it saw to OUT/rank<k>.json: its adapter's
digest before and after, its training and held-out seeds, and the fitness.

With ``vllm-tp2`` the episodes sample through one vLLM engine spanning both ranks
(``tensor_parallel_size: 2``): every turn, each rank submits the whole group's token prompts.

    multiturn_ranks_driver.py OUT [hf|vllm-tp2]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import small_sections

from pbt.algorithms.runtime.member import Member
from pbt.config.read.loader import manifest_from_dict
from pbt.distributed import shutdown, world_info

ENV = '''
import os
from pathlib import Path


class Echo:
    """Two turns; each reply earns its length in characters / 10 (rewards vary within a group)."""

    max_turns = 2

    def __init__(self, log):
        self.log = Path(log) / f"resets-rank{os.environ.get('RANK', '0')}.txt"

    def reset(self, seed=None):
        with self.log.open("a") as f:
            f.write(f"{seed}\\n")
        return f"Say anything ({seed}).", {}

    def step(self, action):
        return "Again.", len(action) / 10, False, False, {}
'''


def adapter_digest(member: Member) -> str:
    """sha256 over the adapter's tensors, in order."""
    h = hashlib.sha256()
    for _, p in member.learner.named_params:
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out, mode = Path(sys.argv[1]), (sys.argv[2:] or ["hf"])[0]
    rollout = {"max_output_tokens": 6}
    if mode == "vllm-tp2":
        rollout |= {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}}
    rank = world_info().rank
    mine = out / f"echo_env.py.{rank}"  # each rank writes the same file, renamed into place
    mine.write_text(ENV)
    mine.replace(out / "echo_env.py")
    sections = small_sections(
        out,
        task={"env": {"file": "echo_env.py", "class": "Echo", "kwargs": {"log": str(out)}},
              "name": None, "eval_size": 4, "train_size": 32},
        algorithm={"group_size": 4, "prompts_per_step": 4},
        rollout=rollout,
        launch={"nproc_per_member": 2},
        optim={"lr": 5e-2},
    )  # fmt: skip
    member = Member(manifest_from_dict(sections, base_dir=out), torch.device("cpu"), "m0")
    task = member.task
    report: dict = {"before": adapter_digest(member)}
    steps = member.train(2)
    report["after"] = adapter_digest(member)
    report["losses"] = [m["loss"] for m in steps]
    report["fitness"] = member.learner.evaluate(task.eval, task.reward)
    report["train_seeds"] = sorted({int(ex.question) for ex in task.train})
    report["eval_seeds"] = sorted(int(ex.question) for ex in task.eval)
    report["digest"] = member.save(out / "ckpt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
