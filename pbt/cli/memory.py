"""``pbt estimate-memory MANIFEST``: what each member of a manifest needs on a GPU, term by
term, whether it fits, and which knob to turn if it does not (the arithmetic is
:mod:`pbt.estimate.memory`); and the warning ``pbt check`` prints when it does not fit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pbt.config import Manifest
from pbt.config.errors import ConfigError
from pbt.config.read.loader import load_manifest
from pbt.estimate.memory import (
    CUDA_CONTEXT_GIB,
    DEFAULT_GPU_GIB,
    DEFAULT_PROMPT_TOKENS,
    GIB,
    Estimate,
    Knob,
    Plan,
    Term,
    advice,
    count_text,
    estimate,
    plan_from_manifest,
)
from pbt.estimate.model_shape import ModelShape, read_model_shape


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``estimate-memory`` with the ``pbt`` command's subcommands."""
    p = sub.add_parser(
        "estimate-memory", help="predict each member's GPU memory and whether it fits"
    )
    p.add_argument("manifest")
    p.add_argument(
        "--gpu-gib",
        type=_positive(float, "--gpu-gib", "the GPU's memory in GiB, e.g. 80 or 140"),
        default=DEFAULT_GPU_GIB,
        help=f"memory of one GPU in GiB (default {DEFAULT_GPU_GIB:g}: an H200)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=_positive(int, "--prompt-tokens", "the longest prompt in tokens, e.g. 256"),
        default=DEFAULT_PROMPT_TOKENS,
        help=f"prompt length in tokens (default {DEFAULT_PROMPT_TOKENS}; a manifest bounds "
        "only the completion)",
    )
    p.add_argument(
        "--model-config",
        help="the model's config.json, for a hub model not in the local cache",
    )
    p.set_defaults(func=run)


def _positive(kind: type, flag: str, fix: str):
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            name = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{flag} ({text!r}) must be {name} > 0; give {fix}")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    """Print the estimate of ``args.manifest``'s members.

    Raises:
        ConfigError: the manifest is invalid, or the model's config cannot be read.
    """
    manifest = load_manifest(args.manifest)
    shape = read_model_shape(manifest, args.model_config)
    plan = plan_from_manifest(manifest, args.prompt_tokens)
    gpu = args.gpu_gib * GIB
    result = estimate(shape, plan, gpu)
    knobs = advice(shape, plan, gpu, manifest.launch.gpus_per_member)
    print(report(manifest, shape, plan, result, knobs, args.gpu_gib))
    return 0


def report(
    manifest: Manifest,
    shape: ModelShape,
    plan: Plan,
    result: Estimate,
    knobs: list[Knob],
    gpu_gib: float,
) -> str:
    """The estimate as text: the model and plan, a table of the terms, the fit, the knobs."""
    lines = [*_header(manifest, shape, plan), "", f"  {'term':<34}{'GiB':>8}  how"]
    phase = result.phase
    sections = (
        ("persistent", result.persistent),
        ("training" + (" (sets the peak)" if phase == "training" else ""), result.training),
        ("rollout" + (" (sets the peak)" if phase == "rollout" else ""), result.rollout),
    )
    for title, terms in sections:
        if terms:
            lines += [f"  {title}", *(_row(t, "    ") for t in terms)]
    members = result.members_per_gpu
    k = plan.members_per_batch
    who = f"{members} member{'s' if members > 1 else ''}"
    if k > 1:
        who = f"{members} worker{'s' if members > 1 else ''} of {k} members"
    lines += [
        _row(Term("peak per rank", result.peak, f"persistent + {phase}"), "  "),
        _row(
            Term(
                "per GPU",
                result.per_gpu,
                f"{who} x (peak + {CUDA_CONTEXT_GIB:g} GiB CUDA context)",
            ),
            "  ",
        ),
    ]
    if result.host:
        lines += ["  host memory per rank", *(_row(t, "    ") for t in result.host)]
    return "\n".join([*lines, "", *_verdict(result, knobs, gpu_gib)])


def _header(manifest: Manifest, shape: ModelShape, plan: Plan) -> list[str]:
    adapted = len([p for p in plan.adapted if p != "lm_head"])
    lines = [
        f"model {manifest.model.name}: {shape.layers} layers, hidden {shape.hidden}, "
        f"{count_text(shape.params())} parameters, {plan.weight_bytes}-byte weights"
        + (" (the blocks' projections 4-bit: model.quantization)" if plan.quantized else ""),
        f"each rank: {plan.micro_batch * plan.per_example * plan.together} sequences per "
        "training forward x "
        f"({plan.prompt_tokens} prompt (--prompt-tokens) + {plan.completion_tokens} completion "
        f"tokens); {plan.rollouts} sequences decoded at once ({plan.engine}); LoRA r "
        f"{plan.lora_r} on {adapted} projections",
        f"ranks per member: {plan.ranks}{' (FSDP2)' if plan.fsdp else ''}; activation "
        f"checkpointing {_on(plan.checkpointing)}, offloading {_on(plan.offloading)}",
    ]
    if plan.members_per_batch > 1:
        k = plan.members_per_batch
        updates = "in one forward a micro-batch (batched_train)" if plan.together > 1 else "in turn"
        lines.append(
            f"a worker hosts {k} members on one base (launch.members_per_batch): their "
            f"rollouts in one batch of {k} x {plan.rollouts} sequences, their updates {updates}"
        )
    if manifest.launch.gpus_per_member == 0:
        lines.append(
            "note: launch.gpus_per_member is 0, so a campaign's members train on the CPU; "
            "these are the figures each would need on a GPU"
        )
    return lines


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _row(term: Term, indent: str) -> str:
    return f"{indent}{term.name:<{36 - len(indent)}}{term.bytes / GIB:>8.2f}  {term.how}"


def _verdict(result: Estimate, knobs: list[Knob], gpu_gib: float) -> list[str]:
    need = result.per_gpu / GIB
    if need <= gpu_gib:
        return [f"fits: {need:.2f} GiB of a {gpu_gib:g} GiB GPU (--gpu-gib)"]
    lines = [f"does not fit: {need:.2f} GiB > a {gpu_gib:g} GiB GPU (--gpu-gib); knobs:"]
    width = max((len(k.setting) for k in knobs), default=0)
    for knob in knobs:
        verdict = "fits" if knob.fits(gpu_gib * GIB) else "not enough alone"
        per_gpu = knob.estimate.per_gpu / GIB
        lines.append(f"  {knob.setting:<{width}} -> {per_gpu:8.2f} GiB per GPU ({verdict})")
    return lines


def memory_warning(manifest: Manifest, path: str | Path) -> str | None:
    """``pbt check``'s warning when members on GPUs would not fit an H200 (None when they fit,
    run on the CPU, or the model's config cannot be read here)."""
    if manifest.launch.gpus_per_member == 0:
        return None
    try:
        shape = read_model_shape(manifest)
    except ConfigError:
        return None
    plan = plan_from_manifest(manifest)
    gpu = DEFAULT_GPU_GIB * GIB
    result = estimate(shape, plan, gpu)
    if result.per_gpu <= gpu:
        return None
    knobs = advice(shape, plan, gpu, manifest.launch.gpus_per_member)
    fitting = [k for k in knobs if k.fits(gpu)]
    fix = (
        f"set {fitting[0].setting} ({fitting[0].estimate.per_gpu / GIB:.1f} GiB)"
        if fitting
        else "no single knob is enough: see the table"
    )
    return (
        f"members need an estimated {result.per_gpu / GIB:.1f} GiB per GPU, more than an "
        f"H200's {DEFAULT_GPU_GIB:g} GiB (prompts of {DEFAULT_PROMPT_TOKENS} tokens assumed); "
        f"{fix}; details: pbt estimate-memory {path}"
    )
