"""Run by tests/integration/test_vllm.py in its own process: the vLLM rollout against the trainer.

One shared-base population on the tiny model with ``rollout.engine: vllm`` (one engine serving
every member's adapter). The driver compares the engine with Hugging Face ``generate`` and the
trainer's forward pass, and writes what it saw to OUT as JSON:

- greedy completions of the base (a fresh adapter) and of a LoRA member, from both;
- the engine's log-probs of sampled tokens against the trainer's;
- the engine's output before and after an optimizer step, and the trainer's after it;
- two members' prompts in one engine batch, against each member's own ``generate``;
- a fresh member trained with vLLM rollouts: held-out reward before and after.

    vllm_driver.py OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import small_sections

from pbt.algorithms.rollout.hf import generate, sequence_logprobs
from pbt.algorithms.runtime.shared_base import SharedBase
from pbt.config.read.loader import manifest_from_dict

CPU = torch.device("cpu")


def completions(batch) -> list[list[int]]:
    """Each row's completion tokens, up to and including EOS."""
    return [
        row[: int(n)].tolist()
        for row, n in zip(batch.completion_ids, batch.completion_mask.sum(1), strict=True)
    ]


def hf_greedy(member, questions) -> list[list[int]]:
    learner = member.learner
    learner.model.eval()
    return completions(
        generate(learner.model, learner.tokenizer, questions, learner.rollout_cfg, greedy=True)
    )


def engine_greedy(member, questions) -> list[list[int]]:
    return completions(member.learner.sample(questions, greedy=True))


def main() -> None:
    out = Path(sys.argv[1])
    sections = small_sections(
        out.parent,
        optim={"lr": 5e-3},
        algorithm={"group_size": 8, "prompts_per_step": 8},
        rollout={"max_output_tokens": 12, "engine": "vllm"},
        task={"eval_size": 32},
        training={"steps": 12},
        population={"size": 3},
    )
    start = time.perf_counter()
    shared = SharedBase(manifest_from_dict(sections, base_dir=out.parent), CPU)
    report: dict = {"engine_start_s": time.perf_counter() - start}
    engine = shared.host.engine
    engine_id = id(engine.llm)

    base = shared.add("m0", seed=1)
    questions = [ex.question for ex in base.task.eval[:8]]
    report["base_hf"] = hf_greedy(base, questions)
    report["base_vllm"] = engine_greedy(base, questions)

    # a LoRA member: the adapter set to random values, so it moves the output away from the base
    lora = shared.add("m1", seed=2)
    shared.activate("m1")  # a shared base trains, samples and saves through the active member
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.learner.named_params:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "lora_B" in name else 0.2))
    lora.learner.adapter_stale = True
    report["lora_hf"] = hf_greedy(lora, questions)
    report["lora_vllm"] = engine_greedy(lora, questions)

    # log-probs of sampled tokens (temperature 0.7): the engine's against the trainer's
    sampled = lora.learner.sample(questions, repeats=4, temperature=0.7)
    with torch.no_grad():
        trainer = sequence_logprobs(lora.model, sampled, 0.7)
    mask = sampled.completion_mask.bool()
    report["logprob_max_gap"] = float((trainer - sampled.logprobs)[mask].abs().max())
    report["logprob_tokens"] = int(mask.sum())

    # one optimizer step (plain SGD with a large step, so greedy outputs surely move)
    shared.activate("m0")
    loads = engine.adapter_loads
    learner = base.learner
    learner.optimizer = torch.optim.SGD([p for _, p in learner.named_params], lr=2.0)
    learner.train_step(base.task.train, base.task.reward)
    report["step_hf"] = hf_greedy(base, questions)
    report["step_vllm"] = engine_greedy(base, questions)
    report["step_adapter_loads"] = engine.adapter_loads - loads
    report["same_engine"] = id(engine.llm) == engine_id

    # two members' prompts in one engine batch, each with its own adapter
    together = shared.complete_all({"m0": questions, "m1": questions}, training=False)
    report["batch_m0"], report["batch_m1"] = (completions(together[m]) for m in ("m0", "m1"))
    report["alone_m0"], report["alone_m1"] = (
        hf_greedy(shared.activate(m), questions) for m in ("m0", "m1")
    )

    # a fresh member learns the letters task with vLLM rollouts
    fresh = shared.add("m2", seed=3)
    shared.activate("m2")
    task, learner = fresh.task, fresh.learner
    report["before"] = learner.evaluate(task.eval, task.reward)
    steps = [learner.train_step(task.train, task.reward) for _ in range(12)]
    report["after"] = learner.evaluate(task.eval, task.reward)
    report["train_metrics"] = steps
    report["train_s"] = sum(m["step_time_s"] for m in steps)
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
