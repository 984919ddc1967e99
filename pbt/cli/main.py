"""The ``pbt`` command line.

    pbt run [MANIFEST] [--dir DIR]   start a campaign (the built-in quickstart without a manifest;
                                     --generations N and the other budget flags set its budget)
    pbt resume DIR [--generations N]  continue a campaign (a budget flag raises its budget)
    pbt status DIR                   generation, members, fitness, hyperparameters, faults
    pbt lineage DIR [--png FILE]     the family tree, as text and as a picture
    pbt inspect CHECKPOINT           what a checkpoint holds, digests checked
    pbt export CHECKPOINT OUT        the adapter as a PEFT folder (or --merge: a full model)
    pbt ui DIR [--port P]            the MLflow UI on a campaign's (or population's) runs
    pbt dashboard DIR [--port P]     optuna-dashboard on a campaign's studies
    pbt train [MANIFEST]             train one member on its own
    pbt check MANIFEST [--resolved]  validate a manifest (--resolved: print what it resolves to)
    pbt estimate-memory MANIFEST     each member's GPU memory, whether it fits, what to turn
    pbt stop DIR                     interrupt a campaign's controller and end its members
    pbt submit MANIFEST --dir DIR    run the controller itself as a Slurm job

User errors print one clear message and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import time
import typing
from pathlib import Path

from pbt import __version__
from pbt.cli import cluster, memory
from pbt.cli.checkpoints import export, inspect_text
from pbt.cli.serve import serve_dashboard, serve_mlflow
from pbt.config import Manifest
from pbt.config.errors import ConfigError, PbtError
from pbt.config.read.canonical import resolved_yaml
from pbt.config.read.loader import load_manifest
from pbt.config.read.overrides import with_environment
from pbt.config.sections.campaign import BudgetConfig
from pbt.controller.budget import FLAGS
from pbt.controller.campaign import Campaign
from pbt.controller.report import fitness_curve_text, lineage_png, lineage_text, status_text
from pbt.launch.placement import placement_for
from pbt.protocol.logs import quiet_library_loggers
from pbt.worker import train
from pbt.worker.train import build_parser as train_parser
from pbt.worker.train import default_manifest_path


def _check(args: argparse.Namespace) -> int:
    """Validate a manifest: its notes, a memory warning and the verdict, one line each on
    stderr (problems: one line each, exit 2); with ``--resolved``, the configuration it
    resolves to, in canonical form, as YAML on stdout."""
    manifest = with_environment(load_manifest(args.manifest))
    if manifest.task.train is not None or any(s.train for s in manifest.task.stages):
        _check_rows(manifest)
    _check_rewards(manifest)
    _check_env(manifest)
    if args.resolved:
        print(resolved_yaml(manifest), end="")
    _print_notes(manifest)
    placement = placement_for(manifest.launch, manifest.rollout.mode)
    if placement.note:
        where = " (on this machine)" if manifest.launch.backend == "local" else ""
        print(f"note: {placement.note}{where}", file=sys.stderr)
    warning = memory.memory_warning(manifest, args.manifest)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{args.manifest}: valid", file=sys.stderr)
    return 0


def _print_notes(manifest: Manifest) -> None:
    """What the user should know that is not a problem, one ``note:`` line each (stderr)."""
    for note in manifest.notes():
        print(f"note: {note}", file=sys.stderr)


def _check_rows(manifest: Manifest) -> None:
    """The first rows of the task's files hold the fields the manifest names (``datasets`` is
    imported only for a manifest with files of its own).

    Raises:
        ConfigError: every problem found, together.
    """
    from pbt.algorithms.data.rows import check_rows

    problems = check_rows(manifest.task, manifest.base_dir, manifest.algorithm.name)
    if problems:
        raise ConfigError(problems)


def _check_rewards(manifest: Manifest) -> None:
    """The user's rewards load and score the first training row with a finite number (their
    code runs here; torch is imported only for a manifest with rewards of its own).

    Raises:
        ConfigError: every problem found, together.
    """
    if not manifest.task.reward_refs():
        return
    from pbt.algorithms.data.tasks import check_rewards

    task, seed = manifest.task, manifest.training.seed
    problems = check_rewards(task, manifest.base_dir, seed, manifest.algorithm.name)
    if problems:
        raise ConfigError(problems)


def _check_env(manifest: Manifest) -> None:
    """A multi-turn environment loads, resets and plays one turn with well-formed results
    (its code runs here; torch is imported only for a manifest with an environment).

    Raises:
        ConfigError: the problem found.
    """
    if manifest.task.env is None:
        return
    from pbt.algorithms.envs.task import check_env

    problems = check_env(manifest.task, manifest.base_dir, manifest.training.seed)
    if problems:
        raise ConfigError(problems)


def _train(args: argparse.Namespace) -> int:

    train.run_member(train.resolve_manifest(args), resume=args.resume)
    return 0


def _interruptible() -> None:
    """``pbt stop`` and Ctrl-C stop the controller with SIGINT. A controller started in the
    background of a script (``pbt run ... &``) inherits SIGINT ignored, and Python then leaves
    it ignored: take the signal back, or ``pbt stop`` would say it interrupted a controller
    that runs on."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(args: argparse.Namespace) -> int:
    _interruptible()
    manifest = args.manifest or default_manifest_path()
    directory = Path(args.dir or f"runs/campaign-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        campaign = Campaign.start(manifest, directory, budget=_budget_flags(args))
        print(f"campaign {directory}: started from {manifest}", flush=True)
        return _drive(campaign)
    except KeyboardInterrupt:
        print(f"\n{interrupted_message(directory)}", file=sys.stderr)
        return 130


def _resume(args: argparse.Namespace) -> int:
    _interruptible()
    directory = Path(args.dir)
    try:
        campaign = Campaign.resume(directory, budget=_budget_flags(args))
        ended = campaign.ended()
        if ended is not None:
            return _finished(campaign, *ended)
        generation = campaign.store.last_committed_generation()
        print(f"campaign {directory}: resuming after generation {generation}", flush=True)
        return _drive(campaign)
    except KeyboardInterrupt:
        print(f"\n{interrupted_message(directory)}", file=sys.stderr)
        return 130


def _budget_flags(args: argparse.Namespace) -> dict[str, typing.Any]:
    """The budget keys given on the command line (``--generations 8``: ``{"generations": 8}``)."""
    return {key: getattr(args, key) for key in FLAGS if getattr(args, key) is not None}


def _finished(campaign: Campaign, key: str, reason: str) -> int:
    """What ``pbt resume`` says of a campaign that has finished: why, and how to go on."""
    try:
        summary = campaign.run()  # returns at once
    finally:
        campaign.close()
    bound = (
        summary.best_fitness if key == "target_fitness" else getattr(campaign.manifest.budget, key)
    )
    quoted, pbt = shlex.quote(str(campaign.dir)), pbt_command()
    print(
        f"campaign {campaign.dir} finished: {reason}; to train further: {pbt} resume {quoted} "
        f"{FLAGS[key]} N (N > {bound:g})"
    )
    print(f"best member {summary.best_member}: fitness {summary.best_fitness:.3f}")
    print(f"more: {pbt} status {quoted} | {pbt} lineage {quoted}")
    return 0


def interrupted_message(directory: Path) -> str:
    """What Ctrl-C during ``pbt run`` or ``pbt resume`` prints: the command that continues."""
    return f"interrupted: resume with {pbt_command()} resume {shlex.quote(str(directory))}"


def pbt_command() -> str:
    """``pbt`` as the user can type it here, for the commands a message suggests: ``pbt`` when
    that is this environment's command on PATH; else this environment's script by its path
    (``.venv/bin/pbt`` after ``./dev quickstart``, which activates nothing); else ``python -m
    pbt.cli`` with this interpreter."""
    bin_dir = Path(sys.executable).parent
    script = bin_dir / "pbt"
    found = shutil.which("pbt")
    if found is not None and Path(found).parent.resolve() == bin_dir.resolve():
        return "pbt"
    if script.is_file():
        relative = os.path.relpath(script)
        return shlex.quote(relative if not relative.startswith("..") else str(script))
    return f"{shlex.quote(sys.executable)} -m pbt.cli"


def _drive(campaign) -> int:

    _print_notes(campaign.manifest)
    try:
        summary = campaign.run()
    finally:
        campaign.close()
    print(f"\nstopped: {summary.stop_reason}")
    print(
        f"best member {summary.best_member}: fitness {summary.best_fitness:.3f}, checkpoint {campaign.dir / summary.best_checkpoint}"
    )
    print("\nlineage of the best member:")
    print(lineage_text(campaign.dir, summary.best_member))
    print("\nfitness by generation:")
    print(fitness_curve_text(campaign.dir))
    quoted, pbt = shlex.quote(str(campaign.dir)), pbt_command()
    print(f"\nmore: {pbt} status {quoted} | {pbt} lineage {quoted}")
    return 0


def _stop(args: argparse.Namespace) -> int:

    for line in cluster.stop(Path(args.dir)):
        print(line)
    return 0


def _submit(args: argparse.Namespace) -> int:

    directory = Path(args.dir)
    job, script = cluster.submit(Path(args.manifest), directory, args.time)
    print(f"submitted the controller as Slurm job {job} ({script})")
    print(f"watch it: pbt status {directory} | tail -f {directory / 'controller.log'}")
    print(f"stop it:  pbt stop {directory}")
    return 0


def _status(args: argparse.Namespace) -> int:

    print(status_text(Path(args.dir)))
    return 0


def _lineage(args: argparse.Namespace) -> int:

    print(lineage_text(Path(args.dir)))
    png = Path(args.png or Path(args.dir) / "lineage.png")
    lineage_png(Path(args.dir), png)
    print(f"\nwrote {png}")
    return 0


def _inspect(args: argparse.Namespace) -> int:

    print(inspect_text(Path(args.checkpoint)))
    return 0


def _export(args: argparse.Namespace) -> int:

    out = export(Path(args.checkpoint), Path(args.out), merge=args.merge)
    print(f"exported {'merged model' if args.merge else 'PEFT adapter'} to {out}")
    return 0


def _ui(args: argparse.Namespace) -> int:

    return serve_mlflow(Path(args.dir), args.port, open_browser=not args.no_browser)


def _dashboard(args: argparse.Namespace) -> int:

    return serve_dashboard(Path(args.dir), args.port)


def _budget_arguments(parser: argparse.ArgumentParser, when: str) -> None:
    """A flag per budget key (``--generations N``, ...): a total for the whole campaign."""
    hints = typing.get_type_hints(BudgetConfig)
    for key, flag in FLAGS.items():
        kind = next(t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None))
        parser.add_argument(
            flag, dest=key, type=kind, metavar="N" if kind is int else "X",
            help=f"budget.{key} for the whole campaign{when}",
        )  # fmt: skip


def _resume_parser(sub: argparse._SubParsersAction) -> None:
    """``pbt resume DIR``, with a flag per budget key that changes it (a total for the whole
    campaign: raise it to train a finished campaign further)."""
    resume = sub.add_parser("resume", help="continue a campaign (optionally with a new budget)")
    resume.add_argument("dir")
    _budget_arguments(resume, " from now on")
    resume.set_defaults(func=_resume)


def build_parser() -> argparse.ArgumentParser:
    """The ``pbt`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="pbt", description="Population-based training for LLM RL."
    )
    parser.add_argument("--version", action="version", version=f"pbt-llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a campaign")
    run.add_argument("manifest", nargs="?", help="YAML manifest (default: the built-in quickstart)")
    run.add_argument("--dir", help="campaign directory (default: runs/campaign-<time>)")
    _budget_arguments(run, " (instead of the manifest's budget section)")
    run.set_defaults(func=_run)
    _resume_parser(sub)
    for name, func, text in (
        ("status", _status, "show a campaign's state"),
        ("stop", _stop, "interrupt a campaign's controller and end its members"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("dir")
        p.set_defaults(func=func)
    lineage = sub.add_parser("lineage", help="show the family tree")
    lineage.add_argument("dir")
    lineage.add_argument("--png", help="where to write the picture (default: DIR/lineage.png)")
    lineage.set_defaults(func=_lineage)
    inspect = sub.add_parser("inspect", help="show what a checkpoint holds")
    inspect.add_argument("checkpoint")
    inspect.set_defaults(func=_inspect)
    export = sub.add_parser("export", help="export a checkpoint's adapter")
    export.add_argument("checkpoint")
    export.add_argument("out")
    export.add_argument(
        "--merge", action="store_true", help="merge into the base model and save it whole"
    )
    export.set_defaults(func=_export)

    for name, func, text, port in (
        ("ui", _ui, "open the MLflow UI on a campaign's runs (localhost only)", 5000),
        ("dashboard", _dashboard, "open optuna-dashboard on a campaign's studies", 8080),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("dir")
        p.add_argument("--port", type=int, default=port)
        p.set_defaults(func=func)
        if name == "ui":
            p.add_argument(
                "--no-browser", action="store_true", help="print the runs page, open nothing"
            )

    train_parser(sub.add_parser("train", help="train one member")).set_defaults(func=_train)
    submit = sub.add_parser("submit", help="run a campaign's controller as a Slurm job")
    submit.add_argument("manifest")
    submit.add_argument("--dir", required=True, help="campaign directory (on a shared disk)")
    submit.add_argument("--time", help="the controller job's --time (default: the partition's)")
    submit.set_defaults(func=_submit)
    check = sub.add_parser("check", help="validate a manifest")
    check.add_argument("manifest")
    check.add_argument(
        "--resolved",
        action="store_true",
        help="print the resolved configuration (every section, translated, as YAML)",
    )
    check.set_defaults(func=_check)
    memory.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pbt`` console script."""
    quiet_library_loggers()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PbtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
