"""Run under torchrun by the library tests: a shared-base population on every rank.

Two members train, are evaluated, cloned, selected, mutated and trained again; one is saved and
loaded into the other. Each rank writes what it saw, for the test to compare across ranks.

    library_driver.py OUT_PREFIX CKPT [--fsdp]
"""

from __future__ import annotations

import argparse
import json

from pbt import create_population
from pbt.distributed import shutdown, world_info
from pbt.distributed.state import gather_parameters


def population_for_driver(fsdp: bool):
    return create_population(
        config={
            "optim": {"lr": 1e-2},
            "algorithm": {"group_size": 4, "prompts_per_step": 2, "micro_batch_size": 2},
            "rollout": {"max_output_tokens": 6},
            "task": {"eval_size": 8},
            "distributed": {"fsdp": True if fsdp else None},
            "training": {"device": "cpu"},
            "mutation": {"rl_hp": 1.0},
        },
        population_size=2,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("ckpt")
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    pop = population_for_driver(args.fsdp)
    for agent in pop:
        agent.train_step()
        agent.test()
    clone = pop[0].clone()
    clone.train_step()
    pop.remove(clone)
    pop = pop.tournament.select(pop)
    pop = pop.mutations.mutation(pop)
    for agent in pop:
        agent.train_step()
        agent.test()
    pop[0].save_checkpoint(args.ckpt)
    pop[1].load_checkpoint(args.ckpt)
    adapters = []
    for agent in pop:
        member = agent._activate()
        full = gather_parameters(member.learner.named_params)
        adapters.append({name: float(t.double().abs().sum()) for name, t in full.items()})
    report = {
        "members": [a.member_id for a in pop],
        "fitness": [a.fitness for a in pop],
        "steps": [a.steps for a in pop],
        "mutations": [a.mutation for a in pop],
        "adapters": adapters,
        "sharded": any(type(p).__name__ == "DTensor" for p in pop._shared().params),
        "memory": pop.memory_bytes(),
    }
    with open(f"{args.out}.rank{world_info().rank}.json", "w") as f:
        json.dump(report, f)
    shutdown()


if __name__ == "__main__":
    main()
