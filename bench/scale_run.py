"""One member at scale: a Qwen3-32B-shaped model with random weights, built directly sharded
with FSDP2, trained with the project's GRPO ``learn`` on synthetic batches.

No rank ever holds the whole model. It is built on the meta device, wrapped with LoRA (r 16,
every linear layer), sharded with ``shard_model`` and the ``FSDPConfig`` defaults, and only then
given storage: ``to_empty`` allocates each rank's shards on its device, and each shard is filled
from counter-based random blocks (one seed per parameter and block of rows), so the weights
depend on the seed alone, not on the world size. Rotary buffers are recomputed from the config.

Figures: tokens/s (all ranks), the step time, peak memory per GPU (peak RSS per rank on the
CPU), each rank's share of the parameters, the time to gather the checkpoint's state (adapter
and optimizer, as a campaign checkpoint gathers it) and its size, and the time to write it.

    torchrun --nproc_per_node=8 bench/scale_run.py --shape 32b --device cuda    # one group
    python bench/scale_run.py --shape 32b --nproc 8 --json out.json             # launches it
    python bench/scale_run.py --shape tiny --nproc 2 --device cpu               # CPU, gloo
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import QWEN2, QWEN3

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "32b": ("qwen3", QWEN3["32b"]),  # Qwen3-32B's published config.json
    "7b": ("qwen2", QWEN2["7b"]),  # Qwen2.5-7B's published config.json
    "tiny": ("qwen3", QWEN3["tiny"]),  # the 32B architecture at a size for CPU tests
}

BLOCK_ELEMENTS = 1 << 24
"""Random values are drawn in blocks of whole rows of about this many elements, each block from
its own seed: a rank draws only the blocks its shard overlaps."""


def model_config(shape: str):
    """The transformers config of ``shape`` (random weights; no download)."""
    from transformers import Qwen2Config, Qwen3Config

    arch, fields = SHAPES[shape]
    fields = dict(fields)
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta", 10000.0)}
    kind = Qwen3Config if arch == "qwen3" else Qwen2Config
    return kind(**fields, rope_parameters=rope, max_window_layers=fields["num_hidden_layers"])


def build_sharded(config, device, dtype, lora_r: int):
    """The LoRA model built on the meta device, sharded, then given storage on ``device``.

    Returns ``(model, base, fsdp)``; no rank allocates more than its shards.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from pbt.algorithms.runtime.models import add_lora
    from pbt.config import LoRAConfig
    from pbt.config.sections.fsdp import FSDPConfig
    from pbt.distributed.fsdp import shard_model

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    base.requires_grad_(False)
    model = add_lora(base, LoRAConfig(r=lora_r, alpha=2 * lora_r, target_modules="all-linear"))
    fsdp = FSDPConfig()
    shard_model(model, base, fsdp, device)
    model.to_empty(device=device)
    return model, base, fsdp


def block_seed(seed: int, name: str, block: int) -> int:
    """The seed of one block of rows of parameter ``name``."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def local_rows(param) -> tuple[Any, int]:
    """This rank's shard of ``param`` and the global index of its first row (dim 0)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.data, 0
    local = param.to_local()
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a Shard(0) parameter, got {param.placements}")
    rows = param.shape[0]
    chunk = math.ceil(rows / param.device_mesh.size())
    start = min(rows, param.device_mesh.get_local_rank() * chunk)
    if local.shape[0] != max(0, min(rows, start + chunk) - start):
        raise ValueError(f"unexpected shard of {tuple(param.shape)}: {tuple(local.shape)}")
    return local, start


def init_scale(name: str, shape: tuple[int, ...], std: float) -> float | None:
    """The std of a parameter's normal init; None for ones (norms), 0.0 for zeros."""
    if "norm" in name:
        return None
    if "lora_B" in name or name.endswith(".bias"):
        return 0.0
    if "lora_A" in name:
        return 1.0 / math.sqrt(shape[1])
    return std


def init_parameters(model, seed: int, std: float) -> None:
    """Fill every local shard; the full weights depend on ``seed`` only, not the world size.

    Parameter ``name`` is cut into blocks of ``rows_per_block`` rows; block ``b`` is drawn from
    ``block_seed(seed, name, b)`` and each rank copies the rows its shard holds.
    """
    import torch

    for name, param in model.named_parameters():
        local, start = local_rows(param)
        scale = init_scale(name, tuple(param.shape), std)
        with torch.no_grad():
            if scale is None or scale == 0.0:
                local.fill_(1.0 if scale is None else 0.0)
                continue
            _fill_normal(local, start, param.shape, name, seed, scale)


def _fill_normal(local, start: int, shape, name: str, seed: int, scale: float) -> None:
    import torch

    rows = local.shape[0]
    if rows == 0:
        return
    row_numel = math.prod(shape[1:])
    per_block = max(1, BLOCK_ELEMENTS // max(1, row_numel))
    gen = torch.Generator(device=local.device)
    for block in range(start // per_block, (start + rows - 1) // per_block + 1):
        first = block * per_block
        count = min(per_block, shape[0] - first)
        gen.manual_seed(block_seed(seed, name, block))
        values = torch.randn((count, *shape[1:]), generator=gen, device=local.device)
        lo, hi = max(first, start), min(first + count, start + rows)
        local[lo - start : hi - start].copy_(values[lo - first : hi - first].mul_(scale))


def init_buffers(model, device) -> None:
    """Recompute the buffers ``to_empty`` left uninitialised (rotary frequencies) from a twin
    of each module built from its config on the CPU."""
    import torch

    for module in model.modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if not hasattr(module, "config"):
            raise ValueError(f"{type(module).__name__} has buffers and no config to rebuild them")
        twin = type(module)(module.config)
        with torch.no_grad():
            for key, buffer in own.items():
                buffer.copy_(getattr(twin, key).to(device=device, dtype=buffer.dtype))


def fingerprint(model) -> list[float]:
    """Sums over every parameter (float64), equal whatever the world size: the sum of its
    values, of their squares, and of each row's sum weighted by its global row index."""
    import torch

    sums = [0.0, 0.0, 0.0]
    for _, param in model.named_parameters():
        local, start = local_rows(param)
        x = local.detach().double().reshape(local.shape[0], -1) if local.dim() else local.double()
        if x.dim() < 2:
            x = x.reshape(-1, 1)
        index = torch.arange(start, start + x.shape[0], device=x.device, dtype=torch.float64)
        sums[0] += float(x.sum())
        sums[1] += float((x * x).sum())
        sums[2] += float((x.sum(dim=1) * (index + 1)).sum())
    return sums


def probe(model, vocab: int, device) -> float:
    """Mean absolute logit on a fixed input (the same on every rank): equal whatever the world
    size when every rank computes with the seeded weights, not with what ``to_empty`` left."""
    import torch

    ids = (torch.arange(32, device=device).reshape(2, 16) * 7919) % vocab
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return float(logits.double().abs().mean())


def shares(model) -> tuple[int, int]:
    """``(elements this rank holds, elements of the whole model)``."""
    held = total = 0
    for _, param in model.named_parameters():
        local, _ = local_rows(param)
        held += local.numel()
        total += param.numel()
    return held, total


def synthetic_batch(seqs: int, prompt: int, completion: int, vocab: int, rank: int, device):
    """A scored batch of random tokens (this rank's share) and its rewards."""
    import torch

    from pbt.algorithms.rollout.hf import RolloutBatch

    gen = torch.Generator().manual_seed(1000 + rank)
    prompt_ids = torch.randint(0, vocab, (seqs, prompt), generator=gen).to(device)
    completion_ids = torch.randint(0, vocab, (seqs, completion), generator=gen).to(device)
    mask = torch.ones(seqs, completion, device=device)
    batch = RolloutBatch(prompt_ids, torch.ones_like(prompt_ids), completion_ids, mask, [""] * seqs)
    return batch, torch.rand(seqs, generator=gen)


def peak_memory_gib(device) -> float:
    """Peak GPU memory allocated on CUDA; peak resident set size on the CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nest of dicts and lists."""
    import torch

    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def time_learn(learner, batch, rewards, args, device) -> tuple[float, float]:
    """Mean seconds per ``learn`` after warm-up, and the last loss."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        learner.learn(batch, rewards)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = learner.learn(batch, rewards)["loss"]
    sync()
    return (time.perf_counter() - start) / args.steps, loss


def checkpoint_figures(model, learner, shape: str, directory: Path | None, rank: int):
    """Gather the adapter and optimizer as a campaign checkpoint does, write it (rank 0)."""
    from pbt.algorithms.runtime.checkpoint import adapter_config, peft_key, save_checkpoint
    from pbt.distributed import barrier
    from pbt.distributed.state import gather_parameters

    start = time.perf_counter()
    trainable = {peft_key(n): t for n, t in gather_parameters(learner.named_params).items()}
    state = learner.state_dict()
    gather_s = time.perf_counter() - start
    attributes = {"trainable": trainable, "learner": state}
    figures = {"gather_s": gather_s, "checkpoint_gib": tensor_bytes(attributes) / 2**30}
    if rank == 0:
        target = directory or Path(tempfile.mkdtemp(prefix="scale-run-"))
        start = time.perf_counter()
        save_checkpoint(target / "checkpoint", attributes, adapter_config(model, f"random:{shape}"))
        figures["save_s"] = time.perf_counter() - start
        files = (target / "checkpoint").rglob("*")
        figures["saved_gib"] = sum(f.stat().st_size for f in files if f.is_file()) / 2**30
        if directory is None:
            shutil.rmtree(target, ignore_errors=True)
    barrier()
    return figures


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of the group: build, train, gather; rank 0 returns the figures."""
    import torch

    from pbt.algorithms.grpo import GRPO
    from pbt.algorithms.runtime.models import quiet_transformers
    from pbt.config import AlgorithmConfig, OptimConfig, RolloutConfig
    from pbt.distributed import (
        all_gather_objects,
        init_process_group,
        pick_device,
        shutdown,
        world_info,
    )

    quiet_transformers()
    world = world_info()
    device = pick_device(args.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_process_group(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(args.shape)
    start = time.perf_counter()
    model, _, fsdp = build_sharded(config, device, dtype, args.lora_r)
    init_parameters(model, args.seed, config.initializer_range)
    init_buffers(model, device)
    build_s = time.perf_counter() - start
    held, total = shares(model)
    model_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    built_peak = peak_memory_gib(device)
    prints = all_gather_objects(fingerprint(model))
    first_logits = probe(model, config.vocab_size, device)
    algo = AlgorithmConfig(
        group_size=args.group,
        prompts_per_step=args.seqs * world.world_size // args.group,
        micro_batch_size=args.micro,
    )
    learner = GRPO(
        model, None, algo, OptimConfig(lr=1e-5), RolloutConfig(), total_steps=1000, fsdp=fsdp
    )
    batch, rewards = synthetic_batch(
        args.seqs, args.prompt, args.completion, config.vocab_size, world.rank, device
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s, loss = time_learn(learner, batch, rewards, args, device)
    train_peak = peak_memory_gib(device)
    ckpt = checkpoint_figures(model, learner, args.shape, args.checkpoint_dir, world.rank)
    per_rank = all_gather_objects(
        {"held": held, "built_peak_gib": built_peak, "train_peak_gib": train_peak}
    )
    shutdown()
    tokens = args.seqs * (args.prompt + args.completion) * world.world_size
    return {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world.world_size,
        "parameters": total,
        "model_gib": model_gib,
        "trainable": sum(p.numel() for _, p in learner.named_params),
        "held_per_rank": [r["held"] for r in per_rank],
        "build_s": build_s,
        "fingerprint": [sum(x) for x in zip(*prints, strict=True)],
        "probe": first_logits,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "tok_s": tokens / step_s,
        "loss": loss,
        "memory": "peak GPU memory allocated" if device.type == "cuda" else "peak RSS",
        "built_peak_gib": [r["built_peak_gib"] for r in per_rank],
        "train_peak_gib": [r["train_peak_gib"] for r in per_rank],
        **ckpt,
    }


def table(r: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    share = max(r["held_per_rank"]) / r["parameters"]
    rows = [
        ("shape", f"{r['shape']} ({_count(r['parameters'])} parameters, {r['device']})"),
        ("ranks", r["world_size"]),
        ("largest share of the parameters on one rank", f"{share:.4f} (1/{1 / share:.2f})"),
        ("trainable (LoRA) parameters", _count(r["trainable"])),
        ("build + init s", f"{r['build_s']:.2f}"),
        ("tokens per step (all ranks)", r["tokens_per_step"]),
        ("s per GRPO learn step", f"{r['step_s']:.3f}"),
        ("tok/s (all ranks)", f"{r['tok_s']:,.0f}"),
        ("whole model, GiB (no rank holds it)", f"{r['model_gib']:.2f}"),
        (f"{r['memory']} after build, GiB (max rank)", f"{max(r['built_peak_gib']):.2f}"),
        (f"{r['memory']} in training, GiB (max rank)", f"{max(r['train_peak_gib']):.2f}"),
        ("checkpoint gather s", f"{r['gather_s']:.2f}"),
        ("checkpoint state GiB (adapter + optimizer)", f"{r['checkpoint_gib']:.3f}"),
        ("checkpoint write s / GiB on disk", f"{r['save_s']:.2f} / {r['saved_gib']:.3f}"),
        ("last loss", f"{r['loss']:+.6f}"),
    ]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run this script as a torchrun group of ``--nproc`` ranks and print its table."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            __file__,
            *argv,
            "--figures",
            str(out),
        ]
        env = {**os.environ}
        env.setdefault("OMP_NUM_THREADS", "1" if args.device == "cpu" else "4")
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            print(f"the torchrun group failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        result = json.loads(out.read_text())
    report(result, args.json)
    return 0


def report(result: dict[str, Any], json_path: Path | None) -> None:
    print(table(result))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))


def default_ranks(device: str) -> int:
    """Every visible GPU, or two CPU ranks."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="32b")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument(
        "--nproc", type=int, help="launch a group of this many ranks (default: every GPU, or 2)"
    )
    parser.add_argument("--seqs", type=int, default=16, help="sequences per rank per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--micro", type=int, default=4, help="sequences per forward pass")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=448)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, help="keep the checkpoint here")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument("--figures", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        if args.nproc is None:
            args.nproc = default_ranks(args.device)
        forwarded = [a for a in argv if not a.startswith("--nproc")]
        if "--nproc" in argv:
            i = argv.index("--nproc")
            forwarded = argv[:i] + argv[i + 2 :]
        return launch(args, forwarded)
    result = worker(args)
    if int(os.environ.get("RANK", 0)) == 0:
        if args.figures is not None:
            args.figures.write_text(json.dumps(result))
        else:
            report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
