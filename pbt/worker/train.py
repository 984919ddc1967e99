"""The member entry point: train one member, evaluate it, checkpoint it.

    torchrun --nproc_per_node=N -m pbt.train manifest.yaml [--device cuda]
    python -m pbt.train manifest.yaml [--device cpu|cuda|auto] [--output-dir DIR] [--steps N]

(:mod:`pbt.train` is the public name of this module's :func:`main`; ``pbt train`` runs it too.)

Without a manifest the built-in quickstart runs. Progress goes to stdout, one line per logged
step, and a line explaining every step that learned nothing; every step's metrics also go to
``<output_dir>/metrics.jsonl``. Training is :meth:`pbt.algorithms.runtime.member.Member.train`, the step
loop campaign members and library mode use too; torch and the algorithms load only when a
member is built, so the argument parsing and manifest checks start instantly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from importlib import resources
from pathlib import Path

from pbt.config import Manifest
from pbt.config.errors import ConfigError, PbtError
from pbt.config.read.loader import load_manifest
from pbt.protocol.logs import quiet_library_loggers
from pbt.worker.stall import StallWatch


def default_manifest_path() -> Path:
    """The packaged quickstart manifest."""
    return Path(str(resources.files("pbt.configs") / "quickstart.yaml"))


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``python -m pbt.train`` (also ``pbt train``)."""
    parser = parser or argparse.ArgumentParser(
        prog="python -m pbt.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "manifest", nargs="?", help="YAML manifest (default: the built-in quickstart)"
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], help="overrides training.device"
    )
    parser.add_argument("--output-dir", help="overrides training.output_dir")
    parser.add_argument("--steps", type=int, help="overrides training.steps")
    parser.add_argument("--resume", help="checkpoint to continue from")
    return parser


def resolve_manifest(args: argparse.Namespace) -> Manifest:
    """Load the manifest and apply command-line overrides (validated like the file)."""
    manifest = load_manifest(args.manifest or default_manifest_path())
    overrides = {
        "device": args.device,
        "output_dir": args.output_dir,
        "steps": args.steps,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        manifest.training = dataclasses.replace(manifest.training, **overrides)
        problems = manifest.training.check("training")
        if problems:
            raise ConfigError(problems, "command line")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    quiet_library_loggers()
    args = build_parser().parse_args(argv)
    try:
        manifest = resolve_manifest(args)
        run_member(manifest, resume=args.resume)
    except PbtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def run_member(manifest: Manifest, resume: str | None = None) -> dict[str, float]:
    """Train, evaluate and checkpoint one member; returns the summary figures.

    Under torchrun every rank runs this; only rank 0 prints and writes files.
    """
    from pbt.algorithms.runtime.member import Member
    from pbt.distributed import pick_device, shutdown, world_info

    world = world_info()
    device = pick_device(manifest.training.device, world.local_rank)
    member = Member(manifest, device)
    if resume:
        member.load(resume)
    log = _RankZeroLog(Path(manifest.training.output_dir), world.rank == 0)
    log.say(_banner(manifest, member, device))
    try:
        return _train_loop(manifest, member, log)
    finally:
        log.close()
        shutdown()


class _RankZeroLog:
    """Progress lines on stdout and metrics in ``metrics.jsonl``, from rank 0 only."""

    def __init__(self, out: Path, enabled: bool) -> None:
        self.out, self.enabled = out, enabled
        self._file = None
        if enabled:
            out.mkdir(parents=True, exist_ok=True)
            self._file = (out / "metrics.jsonl").open("a")

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def record(self, entry: dict[str, float]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _banner(manifest: Manifest, member, device) -> str:
    task = member.task
    world = member.world.world_size
    sharding = "FSDP2" if member.fsdp else "data parallel"
    ranks = f" x{world} ranks ({sharding})" if world > 1 else ""
    return (
        f"pbt-llm: {manifest.algorithm.name} on {manifest.model.name} with LoRA r={manifest.lora.r}, "
        f"task {task.name} ({len(task.train)} train / {len(task.eval)} held-out examples), "
        f"{manifest.training.steps} steps on {device}{ranks}"
    )


def _train_loop(manifest: Manifest, member, log: _RankZeroLog) -> dict[str, float]:
    """Evaluate, train to ``training.steps`` with an evaluation every ``eval_every`` steps,
    evaluate again and save the checkpoint; returns the summary figures.

    A member that collapses (``algorithm.collapse_patience`` steps in a row without signal)
    stops there, as a campaign's task does: the collapse is said once, the member is evaluated
    and saved, and the ``done`` line says at which step it stopped. Its updates were skipped
    already, so the steps left would only repeat that; ``collapse_patience: null`` trains on."""
    cfg = manifest.training
    learner, task = member.learner, member.task
    started = time.perf_counter()
    watch = StallWatch(
        cfg.steps, manifest.optim.lr, manifest.rollout.max_output_tokens, manifest.model.name
    )

    def evaluate() -> float:
        fitness = learner.evaluate(task.eval, task.reward, cfg.eval_temperature)
        log.say(f"eval  step {learner.step:>4}: {learner.fitness_name} {fitness:.3f}")
        log.record({"step": learner.step, "eval_reward": fitness})
        return fitness

    def on_step(step: int, metrics: dict[str, float]) -> None:
        log.record({"step": step, **metrics})
        if step % cfg.log_every == 0 or step == cfg.steps:
            log.say(f"step {step:>4}/{cfg.steps}  {learner.describe(metrics)}")
        stalled = watch.observe(metrics)
        if stalled:
            log.say(f"warning: step {step}: {stalled}")

    first = evaluate()
    while learner.step < cfg.steps:
        until = cfg.steps
        if cfg.eval_every:
            until = min(until, (learner.step // cfg.eval_every + 1) * cfg.eval_every)
        member.train(until - learner.step, on_step, log.say)
        if member.stopped:  # collapsed, and said so once: stop, as a campaign's task does
            break
        if learner.step < cfg.steps:  # an eval_every boundary; the last evaluation follows
            evaluate()
    last = evaluate()
    member.fitness.append(last)
    digest = member.save(log.out / "checkpoint")
    elapsed = time.perf_counter() - started
    ended = f" (collapsed: stopped at step {learner.step} of {cfg.steps})" if member.stopped else ""
    log.say(
        f"done{ended}: {learner.fitness_name} {first:.3f} -> {last:.3f} ({last - first:+.3f}) in "
        f"{elapsed:.0f} s; "
        f"checkpoint {log.out / 'checkpoint'} (sha256 {(digest or '')[:12]})"
    )
    return {"initial_reward": first, "final_reward": last, "seconds": elapsed}


if __name__ == "__main__":
    sys.exit(main())
