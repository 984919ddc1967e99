"""Train-step throughput and memory of one member on 1 GPU, 2 GPUs data parallel, and 2 GPUs
FSDP2 with each FSDPConfig option, printed as ratios to the 1-GPU run.

The model is a Qwen2.5-shaped network with random weights (no download), LoRA r=16 on every
linear layer, and the step is the project's own GRPO ``learn`` on a synthetic batch of
``--seqs`` sequences of ``--prompt + --completion`` tokens per GPU (single pass, beta 0).

    python bench/distributed_throughput.py --shapes 0.5b 1.5b        # runs every mode itself
    torchrun --nproc_per_node=2 bench/distributed_throughput.py --worker --shape 1.5b --mode fsdp

Each mode runs in a fresh torchrun group; figures are the mean of ``--steps`` steps after
``--warmup`` steps. Only ratios measured in one run mean anything: absolute figures move by
several times between machines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import pick

SHAPES = pick("0.5b", "1.5b")
MODES = {
    "1 GPU": (1, "single", []),
    "2 GPU data parallel": (2, "dp", []),
    "2 GPU FSDP2 (defaults)": (2, "fsdp", []),
    "2 GPU FSDP2 reshard_after_forward=False": (2, "fsdp", ["--no-reshard"]),
    "2 GPU FSDP2 optim_cpu_offload=False": (2, "fsdp", ["--no-optim-offload"]),
    "2 GPU FSDP2 defer_grad_sync=False": (2, "fsdp", ["--no-defer"]),
}


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from pbt.algorithms.grpo import GRPO
    from pbt.algorithms.rollout.hf import RolloutBatch
    from pbt.algorithms.runtime.models import add_lora
    from pbt.config import AlgorithmConfig, LoRAConfig, OptimConfig, RolloutConfig
    from pbt.config.sections.fsdp import FSDPConfig
    from pbt.distributed import all_reduce, init_process_group, shutdown, world_info
    from pbt.distributed.fsdp import shard_model
    from pbt.distributed.state import gather_optimizer, gather_parameters

    world = world_info()
    device = torch.device("cuda", world.local_rank)
    torch.cuda.set_device(device)
    init_process_group(device)
    torch.manual_seed(0)
    config = Qwen2Config(**{"max_position_embeddings": 4096, **SHAPES[args.shape]})
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    base.requires_grad_(False)
    model = add_lora(base, LoRAConfig(r=16, alpha=32, target_modules="all-linear"))
    fsdp = None
    if args.mode == "fsdp":
        fsdp = FSDPConfig(
            reshard_after_forward=not args.no_reshard,
            optim_cpu_offload=not args.no_optim_offload,
            defer_grad_sync=not args.no_defer,
        )
        shard_model(model, base, fsdp, device)
    per_gpu = args.seqs
    algo = AlgorithmConfig(
        group_size=8, prompts_per_step=per_gpu * world.world_size // 8, micro_batch_size=args.micro
    )
    learner = GRPO(
        model, None, algo, OptimConfig(lr=1e-5), RolloutConfig(), total_steps=100, fsdp=fsdp
    )

    gen = torch.Generator().manual_seed(world.rank)
    prompt = torch.randint(0, 150000, (per_gpu, args.prompt), generator=gen).to(device)
    completion = torch.randint(0, 150000, (per_gpu, args.completion), generator=gen).to(device)
    batch = RolloutBatch(
        prompt,
        torch.ones_like(prompt),
        completion,
        torch.ones(per_gpu, args.completion, device=device),
        [""] * per_gpu,
    )
    rewards = torch.rand(per_gpu, generator=gen)

    for _ in range(args.warmup):
        learner.learn(batch, rewards)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = learner.learn(batch, rewards)["loss"]
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    peak = all_reduce([torch.cuda.max_memory_allocated() / 2**30], "max")[0]
    start = time.perf_counter()
    gather_parameters(learner.named_params)
    gather_optimizer(learner.named_params, learner.optimizer)
    gather_s = time.perf_counter() - start
    tokens_per_gpu = per_gpu * (args.prompt + args.completion)
    if world.rank == 0:
        result = {
            "tok_s_per_gpu": tokens_per_gpu / elapsed,
            "tok_s_total": tokens_per_gpu * world.world_size / elapsed,
            "step_s": elapsed,
            "peak_gib": peak,
            "gather_s": gather_s,
            "loss": loss,
        }
        Path(args.out).write_text(json.dumps(result))
    shutdown()


def launch(
    shape: str, ranks: int, mode: str, extra: list[str], args: argparse.Namespace
) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = (
        [sys.executable, "-m", "torch.distributed.run"]
        if not Path(torchrun).exists()
        else [torchrun]
    )
    cmd += [
        "--standalone",
        f"--nproc_per_node={ranks}",
        __file__,
        "--worker",
        "--shape",
        shape,
        "--mode",
        mode,
        "--out",
        out,
        "--seqs",
        str(args.seqs),
        "--micro",
        str(args.micro),
        "--prompt",
        str(args.prompt),
        "--completion",
        str(args.completion),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        *extra,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "4"}
    )
    if proc.returncode != 0:
        print(f"  {shape} {mode} {extra} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(Path(out).read_text())


def report(args: argparse.Namespace) -> None:
    print(
        f"# {args.seqs} seqs x {args.prompt + args.completion} tokens per GPU, micro-batch "
        f"{args.micro}, LoRA r=16 all-linear, bf16, GRPO learn (single pass)"
    )
    header = (
        "| mode | tok/s per GPU | tok/s total | x 1 GPU (total) | peak GiB/GPU | x 1 GPU (mem) |"
    )
    for shape in args.shapes:
        print(f"\n## Qwen2.5-{shape.upper()} shape, random weights")
        print(header + " gather s | last loss |")
        print("|---" * 8 + "|")
        base = None
        for name, (ranks, mode, extra) in MODES.items():
            if args.only and mode not in args.only and name != "1 GPU":
                continue
            r = launch(shape, ranks, mode, extra, args)
            if r is None:
                print(f"| {name} | failed |" + " |" * 6)
                continue
            base = base or r
            cells = [
                f"{r['tok_s_per_gpu']:,.0f}",
                f"{r['tok_s_total']:,.0f}",
                f"{r['tok_s_total'] / base['tok_s_total']:.2f}",
                f"{r['peak_gib']:.1f}",
                f"{r['peak_gib'] / base['peak_gib']:.2f}",
                f"{r['gather_s']:.2f}",
                f"{r['loss']:+.5f}",
            ]
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--shape", choices=SHAPES)
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=list(SHAPES))
    parser.add_argument("--mode", choices=["single", "dp", "fsdp"])
    parser.add_argument("--out")
    parser.add_argument(
        "--only", nargs="+", choices=["dp", "fsdp"], help="modes to run besides 1 GPU"
    )
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=448)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-reshard", action="store_true")
    parser.add_argument("--no-optim-offload", action="store_true")
    parser.add_argument("--no-defer", action="store_true")
    args = parser.parse_args()
    worker(args) if args.worker else report(args)


if __name__ == "__main__":
    main()
