"""Run under torchrun (or plain python) by the distributed tests.

Trains a member on fixed synthetic batches, so runs at different world sizes see exactly the
same global batch, and writes what it saw (losses, gathered adapter) for the test to compare.

    driver.py OUT.json --steps N [--fsdp] [--no-defer] [--checkpointing] [--save-at K CKPT]
        [--load CKPT] [--quantize]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from pbt.algorithms.rollout.hf import RolloutBatch, chat_prompts
from pbt.algorithms.runtime.member import Member, local_shard
from pbt.config.read.loader import manifest_from_dict
from pbt.distributed import CollectiveError, shutdown, world_info
from pbt.distributed.state import gather_parameters

PROMPTS, GROUP, LENGTH = 4, 4, 6


def manifest(
    fsdp: dict | bool | None,
    timeout_s: float = 600.0,
    checkpointing: bool = False,
    quantize: bool = False,
):
    return manifest_from_dict(
        {
            # float32 compute: the comparisons across world sizes see the sharding, not bfloat16
            # rounding amplified by Adam
            "model": {
                "quantization": {"quant_type": "nf4", "compute_dtype": "float32"}
                if quantize
                else None
            },
            "optim": {"lr": 5e-3, "warmup_steps": 1},
            "algorithm": {
                "group_size": GROUP,
                "prompts_per_step": PROMPTS,
                "beta": 0.1,
                "update_epochs": 2,
                "micro_batch_size": 2,
            },
            "rollout": {"max_output_tokens": LENGTH},
            "task": {"eval_size": 8},
            "distributed": {"fsdp": fsdp, "timeout_s": timeout_s},
            "training": {
                "steps": 10,
                "device": "cpu",
                "activation_checkpointing": checkpointing,
            },
        }
    )


def global_batch(member: Member, step: int) -> tuple[RolloutBatch, torch.Tensor]:
    """The same batch on every rank and world size: prompts, random completions, rewards."""
    gen = torch.Generator().manual_seed(1000 + step)
    questions = [ex.question for ex in member.task.train[step * PROMPTS : (step + 1) * PROMPTS]]
    texts = [p for p in chat_prompts(member.tokenizer, questions) for _ in range(GROUP)]
    enc = member.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    vocab = len(member.tokenizer)
    completions = torch.randint(3, vocab, (len(texts), LENGTH), generator=gen)
    mask = torch.ones(len(texts), LENGTH)
    mask[::3, LENGTH - 2 :] = 0.0  # some shorter completions
    rewards = torch.rand(len(texts), generator=gen)
    rewards[2 * GROUP : 3 * GROUP] = 0.5  # one zero-signal group: ranks drop unequal rows
    batch = RolloutBatch(
        enc["input_ids"], enc["attention_mask"], completions, mask, [""] * len(texts)
    )
    return batch, rewards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--no-defer", action="store_true")
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint every block")
    parser.add_argument("--quantize", action="store_true", help="a 4-bit base (QLoRA)")
    parser.add_argument("--save-at", nargs=2)
    parser.add_argument("--load")
    parser.add_argument("--hang-rank", type=int, help="this rank sleeps instead of training")
    args = parser.parse_args()
    fsdp = {"defer_grad_sync": not args.no_defer} if args.fsdp else None
    timeout = 5.0 if args.hang_rank is not None else 600.0
    member = Member(manifest(fsdp, timeout, args.checkpointing, args.quantize), torch.device("cpu"))
    if args.hang_rank == world_info().rank:
        time.sleep(60)
    if args.load:
        member.load(args.load)
    world = world_info()
    share = len(range(PROMPTS * GROUP)) // world.world_size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    losses = {}
    while member.learner.step < args.steps:
        batch, rewards = global_batch(member, member.learner.step)
        metrics = member.learner.learn(batch.select(rows), rewards[rows])
        losses[member.learner.step] = metrics["loss"]
        if args.save_at and member.learner.step == int(args.save_at[0]):
            member.save(args.save_at[1])
    adapter = gather_parameters(member.learner.named_params)
    if world.rank == 0:
        torch.save(adapter, args.out + ".pt")
        with open(args.out, "w") as f:
            checkpointed = sum(
                getattr(m, "pbt_checkpointed", False) for m in member.model.modules()
            )
            frozen = [local_shard(p) for p in member.model.parameters() if not p.requires_grad]
            out = {
                "losses": losses,
                "world_size": world.world_size,
                "checkpointed": checkpointed,
                "base_bytes": sum(t.numel() * t.element_size() for t in frozen),
            }
            json.dump(out, f)
    shutdown()


if __name__ == "__main__":
    try:
        main()
    except CollectiveError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)
