"""Run under torchrun (2 ranks) by tests/integration/test_vllm.py: a member with vLLM rollouts.

``offload``: FSDP2 with ``cpu_offload`` (allowed only with vLLM rollouts), an engine per rank.
``tp2``: data parallel, one engine with ``tensor_parallel_size: 2`` spanning both ranks.

Each rank compares the engine's greedy completions with Hugging Face ``generate`` on the same
(sharded) model, trains two steps, evaluates, saves a checkpoint to OUT/ckpt, and writes what it
saw to OUT/rank<k>.json.

    vllm_torchrun_driver.py OUT offload|tp2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import small_sections
from vllm_driver import completions

from pbt.algorithms.rollout.hf import generate
from pbt.algorithms.runtime.member import Member
from pbt.config.read.loader import manifest_from_dict
from pbt.distributed import shutdown, world_info
from pbt.distributed.fsdp import is_sharded


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    vllm = {"tensor_parallel_size": 2} if mode == "tp2" else {}
    fsdp = {"cpu_offload": True, "optim_cpu_offload": False} if mode == "offload" else None
    sections = small_sections(
        out,
        rollout={"max_output_tokens": 8, "engine": "vllm", "vllm": vllm},
        distributed={"fsdp": fsdp},
        launch={"nproc_per_member": 2},
        optim={"lr": 2e-2},
    )
    member = Member(manifest_from_dict(sections, base_dir=out), torch.device("cpu"), "m0")
    learner, task, rank = member.learner, member.task, world_info().rank
    questions = [ex.question for ex in task.eval[rank * 4 : rank * 4 + 4]]
    report: dict = {"sharded": is_sharded(member.model)}
    for when in ("start", "trained"):
        report[f"{when}_vllm"] = completions(learner.sample(questions, greedy=True))
        learner.model.eval()
        hf = generate(
            learner.model, learner.tokenizer, questions, learner.rollout_cfg, greedy=True,
            synced=is_sharded(member.model),
        )  # fmt: skip
        report[f"{when}_hf"] = completions(hf)
        if when == "start":
            report["losses"] = [
                learner.train_step(task.train, task.reward)["loss"] for _ in range(2)
            ]
    report["fitness"] = learner.evaluate(task.eval, task.reward)
    report["adapter_loads"] = member.host.engine.adapter_loads
    member.save(out / "ckpt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
