"""Run under torchrun by tests/unit/algorithms/test_agilerl_agents.py: AgileRL's multi-GPU page, as its user
types it, with only the model name and the import paths changed.

    agilerl_agent_driver.py OUT dp     GRPO(..., vllm_config=VLLMConfig()), data parallel
    agilerl_agent_driver.py OUT fsdp   GRPO(..., fsdp_config=fsdp_config) and
                                       GRPO.population(size=4, ..., fsdp_config=..., **init_hp)

The agent samples this rank's prompts (``get_action``), learns two steps and is saved by every
rank into ``OUT/ckpt``. Each rank writes ``OUT/rank<r>.json`` (what it saw) and
``OUT/adapter.rank<r>.pt`` (its full adapter after the steps) for the test to compare.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pbt.algorithms import GRPO, VLLMConfig
from pbt.algorithms.runtime.checkpoint import peft_key
from pbt.algorithms.runtime.models import resolve_model_path
from pbt.distributed import FSDPConfig, shutdown, world_info
from pbt.distributed.state import gather_parameters

MODEL = "builtin:tiny"
tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
init_hp = {"group_size": 4, "batch_size": 2, "max_output_tokens": 6, "lr": 1e-2}
"""Small enough for two CPU ranks; the page leaves them at their defaults."""


def train(agent: GRPO, steps: int = 2) -> dict:
    """Sample, score and learn ``steps`` times on this rank's prompts; what the rank saw."""
    seen: dict = {"prompts": [], "losses": [], "class": type(agent).__name__}
    for _ in range(steps):
        prompts = agent.sample_prompts()
        completions = agent.get_action(prompts)
        metrics = agent.learn((completions, agent.reward(prompts, completions)))
        seen["prompts"].append([p.question for p in prompts])
        seen["losses"].append(metrics["loss"])
        seen["grad_norm"] = metrics["grad_norm"]
    seen["steps"] = agent.steps
    return seen


def adapter(agent: GRPO) -> dict[str, torch.Tensor]:
    """The agent's whole adapter, as its checkpoint names it (gathered from shards)."""
    named = agent._activate().learner.named_params
    return {peft_key(name): t for name, t in gather_parameters(named).items()}


def data_parallel(out: Path) -> dict:
    agent = GRPO(
        model_name=MODEL,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        vllm_config=VLLMConfig(),
        # no fsdp_config — data parallel
        **init_hp,
    )
    seen = train(agent)
    agent.save_checkpoint(out / "ckpt")
    torch.save(adapter(agent), out / f"adapter.rank{world_info().rank}.pt")
    seen["engine"] = agent.population.manifest.rollout.engine
    seen["sharded"] = _sharded(agent)
    return seen


def sharded(out: Path) -> dict:
    fsdp_config = FSDPConfig(
        reshard_after_forward=True,
        cpu_offload=False,
        optim_cpu_offload=True,
        defer_grad_sync=True,
    )
    agent = GRPO(
        model_name=MODEL,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        fsdp_config=fsdp_config,
        **init_hp,
    )
    seen = train(agent)
    agent.save_checkpoint(out / "ckpt")
    torch.save(adapter(agent), out / f"adapter.rank{world_info().rank}.pt")
    seen["sharded"] = _sharded(agent)
    population = GRPO.population(
        size=4,
        model_name=MODEL,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        fsdp_config=fsdp_config,
        **init_hp,
    )
    last = population[3]
    seen["population"] = {
        "classes": [type(a).__name__ for a in population],
        "members": [a.member_id for a in population],
        "last": train(last, steps=1),
        "sharded": _sharded(last),
        "untrained_steps": population[0].steps,
    }
    return seen


def _sharded(agent: GRPO) -> bool:
    return any(type(p).__name__ == "DTensor" for p in agent.population._shared().params)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    seen = data_parallel(out) if mode == "dp" else sharded(out)
    (out / f"rank{world_info().rank}.json").write_text(json.dumps(seen))
    shutdown()


if __name__ == "__main__":
    main()
