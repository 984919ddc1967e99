"""Proof of value: with N slots for T steps each, is the best model better from PBT than from the
library's defaults, random search, or Optuna TPE with pruning, each on the same N x T steps?

    python bench/proof_of_value.py sweep --tasks addition         # sensitivity: lr x temperature
    python bench/proof_of_value.py compare --seeds 5 --parallel 2 # both tasks, 4 strategies
    python bench/proof_of_value.py compare --shape micro --seeds 1 --parallel 2   # a dry run
    python bench/proof_of_value.py compare --shape h200 --device cuda --parallel 1 --seeds 5

Every strategy is a real campaign (its own directory and SQLite store, members as worker
processes) and trains exactly ``slots x steps`` member-steps, at most ``slots`` members at a
time (a campaign trains one generation of at most ``slots`` members, then selects):

- ``pbt``: population ``slots``, ``steps / evo_steps`` generations of ``evo_steps`` steps;
  generation 0 drawn at random from the search space, then truncation selection (the bottom
  quarter copies the top quarter) and mutation of the copies (:data:`PBT_SETTINGS`).
- ``pbt_ready``: ``pbt`` with ``population.ready_generations`` 3: nobody is replaced before
  every lineage has trained 3 generations (not run unless named in ``--strategies``).
- ``pbt_gap``: ``pbt_ready`` with ``population.exploit_gap`` 0.04: a bottom member is replaced
  only by a member more than 0.04 fitter, about one standard error of the difference of two
  evaluations on 256 problems at a reward near 0.6 (sqrt(2 x 0.6 x 0.4 / 256) = 0.043); not run
  unless named.
- ``pb2``: ``pbt_ready`` with PB2's explore (``search.strategy: pb2``): each copy's
  hyperparameters are the choice of a GP bandit over every member's change of fitness, in
  place of a x0.8 / x1.2 perturbation; not run unless named.
- ``random``: the ``optuna`` strategy, sampler ``random``, no pruner, trials as long as the
  campaign: ``slots`` trials of ``steps`` steps, one per slot.
- ``tpe``: the ``optuna`` strategy, sampler ``tpe`` (multivariate, constant liar), successive
  halving; a pruned trial's slot starts a new trial at the next generation, guided by every
  finished and pruned trial once ``startup_trials`` of them exist.
- ``default``: what a user gets without a search: the library's own defaults
  (``OptimConfig.lr`` 1e-5, ``RolloutConfig.temperature`` 1.0), ``slots`` runs of ``steps``
  steps with different seeds (campaigns of one member, never mutated).

The best model of a strategy is its best member by eval reward (the held-out split every
strategy selects on); its final figure is that member's reward on a test split that no strategy
sees. Compute is member-steps; a curve's point after generation g is the best eval reward of any
member trained so far against the member-steps spent so far.

Tasks: ``addition`` (``builtin:addition``, its warm-started model) and ``chain_sum`` (rows of
reasoning-gym's ``chain_sum``, three one-digit terms with + and -, written as JSONL files
and used as the user's own data, on a model warm-started the same way). Both have fixed
train / eval / test splits, disjoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml
from proof_stats import (
    PBT_VARIANTS,
    STRATEGIES,
    Curve,
    envelope,
    format_summary,
    merge,
    plot_curves,
    plot_sweep,
    summarize,
)
from proof_tasks import TASKS, task_section, task_splits, warm_model, write_task_files

COMPARED = ("pbt", "random", "tpe", "default")
"""What ``compare`` runs unless told; ``pbt_ready`` is PBT with a burn-in of
:data:`READY_GENERATIONS` generations before the first exploit."""
READY_GENERATIONS = 3
EXPLOIT_GAP = 0.04


@dataclass(frozen=True, slots=True)
class Shape:
    """A model size and the campaign sizes that go with it."""

    warm_model: dict[str, object] = field(default_factory=dict)
    """Qwen2 config fields over the tiny model's (empty: the tiny model)."""
    warm_steps: dict[str, int] = field(default_factory=lambda: {"addition": 375, "chain_sum": 600})
    """Supervised warm-start steps per task: the model must stay well short of its ceiling."""
    slots: int = 8
    """N: members at once, the same for every strategy."""
    steps: int = 40
    """T: training steps per slot."""
    evo_steps: int = 5
    """k: PBT's steps per generation (and every strategy's reporting interval)."""
    eval_size: int = 256
    test_size: int = 256
    group_size: int = 8
    prompts_per_step: int = 8
    startup_trials: int = 4
    """TPE: finished or pruned trials before the sampler models them."""
    pbt: dict[str, object] = field(default_factory=dict)
    """Population and mutation settings of the ``pbt`` strategy over :data:`PBT_SETTINGS`."""
    launch: dict[str, object] = field(default_factory=dict)
    """Launch settings over the CPU's (one member at a time per campaign)."""

    @property
    def generations(self) -> int:
        return self.steps // self.evo_steps


PBT_SETTINGS: dict[str, dict[str, object]] = {
    "population": {"selection": "truncation", "truncation_fraction": 0.25},
    "mutation": {"no_mutation": 0.2, "rl_hp": 0.8},
}
"""The PBT strategy's selection and mutation (``--pbt`` overrides them): truncation, chosen
over tournament of 2 by a sweep on other seeds (bench/RESULTS.md)."""

SHAPES: dict[str, Shape] = {
    # 2-core CPU: one campaign (8 x 40 member-steps) is about two minutes at one thread.
    "cpu": Shape(),
    # the dry run: seconds per campaign
    "micro": Shape(
        warm_steps={"addition": 20, "chain_sum": 20},
        slots=3,
        steps=4,
        evo_steps=2,
        eval_size=8,
        test_size=8,
        group_size=2,
        prompts_per_step=2,
        startup_trials=1,
    ),
    # one H200: each campaign's 8 members on it at once under MPS, a larger batch; the same
    # warm-started models as the CPU's (their sweeps calibrate them)
    "h200": Shape(
        eval_size=512,
        test_size=256,
        group_size=16,
        prompts_per_step=16,
        launch={"slots": 8, "members_per_gpu": 8, "mps": True, "gpus_per_member": 1},
    ),
}

RANGES = {
    "lr": {"min": 1.0e-4, "max": 3.0e-2, "log": True},
    "temperature": {"min": 0.5, "max": 1.5},
}
"""The search space, the same for every searching strategy."""

# -- manifests ------------------------------------------------------------------------------


def base_manifest(task: str, shape: Shape, model: str, data: Path, device: str, seed: int) -> dict:
    """What every strategy's manifest shares: model, task, algorithm, evaluation, budget."""
    launch = {
        "slots": 1,
        "gpus_per_member": 1 if device == "cuda" else 0,
        "persistent_workers": True,
    } | shape.launch
    return {
        "model": {"name": model},
        "lora": {"r": 8, "alpha": 16},
        "algorithm": {
            "group_size": shape.group_size,
            "prompts_per_step": shape.prompts_per_step,
            "beta": 0.0,
            # a member whose groups all tie keeps training: every member trains its k steps
            "collapse_patience": None,
        },
        "rollout": {"max_output_tokens": 5},
        "task": task_section(task, shape, data),
        "training": {"seed": seed, "device": device, "output_dir": "member"},
        "population": {"size": shape.slots, "evo_steps": shape.evo_steps},
        "mutation": {"ranges": RANGES},
        "budget": {"generations": shape.generations},
        "launch": launch,
        "tracking": {"enabled": False},
    }


def strategy_manifests(
    strategy: str, task: str, shape: Shape, model: str, data: Path, device: str, seed: int
) -> list[dict]:
    """The campaigns of one strategy for one seed (``default``: one per slot); together they
    train ``shape.slots x shape.steps`` member-steps."""
    m = base_manifest(task, shape, model, data, device, seed)
    if strategy in PBT_VARIANTS:
        m["population"] |= {"init_sampler": "random"} | PBT_SETTINGS["population"]
        m["mutation"] |= PBT_SETTINGS["mutation"]
        for key, value in shape.pbt.items():
            m[key] = m[key] | value
        if strategy in ("pbt_ready", "pbt_gap", "pb2"):
            m["population"]["ready_generations"] = READY_GENERATIONS
        if strategy == "pbt_gap":
            m["population"]["exploit_gap"] = EXPLOIT_GAP
        if strategy == "pb2":
            m["search"] = {"strategy": "pb2"}
        return [m]
    if strategy in ("random", "tpe"):
        m["search"] = {
            "strategy": "optuna",
            "sampler": strategy,
            "pruner": "none" if strategy == "random" else "successive_halving",
            "trial_generations": shape.generations,
            "startup_trials": shape.startup_trials,
        }
        return [m]
    if strategy == "default":
        runs = []
        for run in range(shape.slots):
            one = json.loads(json.dumps(m))
            one["training"]["seed"] = seed * 1000 + run
            one["population"] |= {"size": 1, "tournament_size": 1, "init_sampler": "none"}
            # never mutated; the library's own ranges, which hold its default lr
            one["mutation"] = {"no_mutation": 1.0, "rl_hp": 0.0}
            runs.append(one)
        return runs
    raise ValueError(f"strategy ({strategy!r}) must be one of {', '.join(STRATEGIES)}")


# -- running campaigns ----------------------------------------------------------------------


MEMBER_COMMAND = [sys.executable, "-m", "pbt.worker"]
"""Members have one rank each: the worker runs without torchrun, so campaigns running side by
side never race for a rendezvous port."""


def run_campaigns(
    jobs: list[tuple[dict, Path]],
    parallel: int,
    env: dict[str, str],
    deadline: float = math.inf,
) -> None:
    """Run each (manifest, directory) as a campaign in a child process, in order, as many at
    once as keep the members training at once (each campaign's ``launch.slots``) within
    ``parallel``; a directory that already holds a finished campaign of the same manifest is
    kept (the harness can be re-run). None starts after ``deadline`` (``time.monotonic()``).

    Raises:
        ValueError: a directory holds a finished campaign of another manifest.
        RuntimeError: a campaign failed; its log is named.
    """
    queue = [(m, d) for m, d in jobs if not _finished(m, d)]
    running: list[tuple[subprocess.Popen, Path, float, int]] = []
    failed = []

    def width(manifest: dict) -> int:
        return min(manifest["launch"].get("slots", 1), manifest["population"]["size"])

    while (queue and time.monotonic() < deadline) or running:
        while (
            queue
            and time.monotonic() < deadline
            and (not running or sum(r[3] for r in running) + width(queue[0][0]) <= parallel)
        ):
            manifest, directory = queue.pop(0)
            shutil.rmtree(directory, ignore_errors=True)  # an unfinished earlier attempt
            directory.parent.mkdir(parents=True, exist_ok=True)
            path = directory.parent / f"{directory.name}.yaml"
            path.write_text(yaml.safe_dump(manifest, sort_keys=False))
            command = [sys.executable, __file__, "campaign", str(path), "--dir", str(directory)]
            with open(directory.parent / f"{directory.name}.log", "w") as log:
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((proc, directory, time.monotonic(), width(manifest)))
        time.sleep(0.2)
        for item in [r for r in running if r[0].poll() is not None]:
            proc, directory, started, _ = item
            running.remove(item)
            if proc.returncode != 0 or not (directory / "store.db").exists():
                failed.append(directory)
                print(f"  FAILED {directory.name} (exit {proc.returncode})", flush=True)
                continue
            wall = time.monotonic() - started
            (directory / "finished.json").write_text(json.dumps({"wall_s": wall}))
            print(f"  finished {directory.name} in {wall:.0f} s", flush=True)
    if failed:
        logs = ", ".join(str(d.parent / f"{d.name}.log") for d in failed)
        raise RuntimeError(f"{len(failed)} campaigns failed; see {logs}")


def _finished(manifest: dict, directory: Path) -> bool:
    from pbt.config.read.loader import manifest_from_dict

    if not (directory / "finished.json").exists():
        return False
    written = directory.parent / f"{directory.name}.yaml"
    earlier = asdict(manifest_from_dict(yaml.safe_load(written.read_text()), directory.parent))
    if earlier != asdict(manifest_from_dict(manifest, directory.parent)):
        raise ValueError(
            f"{directory} holds a finished campaign of another manifest ({written}); pass "
            "another --work-dir or delete it"
        )
    return True


def run_one(manifest: Path, directory: Path) -> None:
    """One campaign, start to end, with the one-rank member command."""
    from pbt.controller.campaign import Campaign

    campaign = Campaign.start(manifest, directory, member_command=MEMBER_COMMAND)
    try:
        summary = campaign.run()
    finally:
        campaign.close()
    print(f"stopped: {summary.stop_reason}; best {summary.best_member} {summary.best_fitness:.3f}")


# -- reading campaigns ----------------------------------------------------------------------


def spent(directory: Path) -> dict:
    """What a finished campaign trained, read back from its store: member-steps in all, per
    generation, members per generation, and whether every launch of a generation happened
    after the previous generation was committed (so no two generations overlapped)."""
    import sqlite3

    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        config = store.load_config()
        members = [
            m
            for m in store.members()
            if m.status == "done" and not (m.mutation or "").startswith("replaced")
        ]
    evo_steps = config["manifest"]["population"]["evo_steps"]
    per_generation: dict[int, int] = {}
    trained: dict[int, int] = {}
    for m in members:
        per_generation[m.generation] = per_generation.get(m.generation, 0) + 1
        steps = int(m.metrics.get("trained_steps", evo_steps))
        trained[m.generation] = trained.get(m.generation, 0) + steps
    db = sqlite3.connect(directory / STORE_FILENAME)
    committed = dict(db.execute("SELECT generation, committed_at FROM generations"))
    launches = db.execute(
        "SELECT m.generation, l.created_at FROM launches l JOIN members m USING (member_id)"
    ).fetchall()
    db.close()
    ordered = all((g == 0 or at >= committed[g - 1]) and at <= committed[g] for g, at in launches)
    return {
        "member_steps": sum(trained.values()),
        "steps_per_generation": [trained[g] for g in sorted(trained)],
        "members_per_generation": [per_generation[g] for g in sorted(per_generation)],
        "launches": len(launches),
        "generations_in_order": ordered,
    }


def read_curve(directories: list[Path], task: str, strategy: str, seed: int) -> Curve:
    """The strategy's reward-vs-compute curve from its campaigns' stores (several campaigns,
    as ``default``'s, run side by side: their generations add up)."""
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    by_generation: dict[int, list[tuple[int, float]]] = {}
    for directory in directories:
        with CampaignStore(directory / STORE_FILENAME) as store:
            members = [m for m in store.members() if m.status == "done" and m.fitness_history]
            evo_steps = store.load_config()["manifest"]["population"]["evo_steps"]
        for m in members:
            steps = int(m.metrics.get("trained_steps", evo_steps))
            by_generation.setdefault(m.generation, []).append((steps, m.fitness_history[-1]))
    steps, reward, spent_steps, best = [], [], 0, -math.inf
    for generation in sorted(by_generation):
        for trained, fitness in by_generation[generation]:
            spent_steps += trained
            best = max(best, fitness)
        steps.append(spent_steps)
        reward.append(best)
    wall = sum(json.loads((d / "finished.json").read_text())["wall_s"] for d in directories)
    return Curve(task, strategy, seed, steps, reward, wall_s=wall)


_SCORERS: dict[str, object] = {}


def best_member_reward(directory: Path, problems: list[tuple[str, str]]) -> dict:
    """The campaign's best member by eval reward, loaded from its checkpoint and scored on
    ``problems`` by the members' own evaluation (greedy at ``eval_temperature``)."""
    import torch

    from pbt.algorithms.data.tasks import Example
    from pbt.algorithms.runtime.member import Member
    from pbt.config.read.loader import manifest_from_dict
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        member_id, eval_reward = store.best()
        checkpoint = store.member(member_id).checkpoint
        config = store.load_config()
    manifest = manifest_from_dict(config["manifest"], base_dir=config["base_dir"])
    # one member per model and task, its adapter swapped by each load: scoring many campaigns
    # loads the base model and the task once
    key = json.dumps([config["manifest"][k] for k in ("model", "lora", "task")], sort_keys=True)
    key += manifest.training.device
    if key not in _SCORERS:
        _SCORERS[key] = Member(manifest, torch.device(manifest.training.device))
    member = _SCORERS[key]
    member.load(directory / checkpoint)
    reward = member.learner.evaluate(
        [Example(q, a) for q, a in problems],
        member.task.reward,
        manifest.training.eval_temperature,
    )
    return {"member": member_id, "eval_reward": eval_reward, "reward": reward}


def test_reward(directory: Path, problems: list[tuple[str, str]]) -> dict:
    """:func:`best_member_reward` on the test split, kept in ``<campaign>/test.json``."""
    cached = directory / "test.json"
    if cached.exists():
        scored = json.loads(cached.read_text())
        if scored["problems"] == len(problems):
            return scored
    scored = best_member_reward(directory, problems) | {"problems": len(problems)}
    cached.write_text(json.dumps(scored))
    return scored


def score(directories: list[Path], curve: Curve, problems: list[tuple[str, str]]) -> Curve:
    """Fill the curve's test figures: the best campaign's best member (by eval reward) on the
    test split, and for several campaigns the mean over their best members."""
    scored = [test_reward(d, problems) for d in directories]
    best = max(scored, key=lambda s: s["eval_reward"])
    curve.test_reward = best["reward"]
    curve.test_mean = statistics.fmean(s["reward"] for s in scored)
    return curve


def tpe_trials(directory: Path, startup_trials: int) -> dict:
    """How many of a search campaign's trials TPE drew from its model: those asked once at
    least ``startup_trials`` trials had finished or been pruned (before, it draws at random),
    how many were pruned, and the generation of the first guided one."""
    import optuna

    from pbt.evolution.search import study_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = study_storage(directory)
    name = optuna.study.get_all_study_names(storage)[0]
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    ended = [t.datetime_complete for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    guided = [
        t
        for t in trials
        if t.datetime_start is not None
        and sum(e is not None and e <= t.datetime_start for e in ended) >= startup_trials
    ]
    first = min((int(t.user_attrs["member_id"][1:4]) for t in guided), default=None)
    pruned = sum(t.state.name == "PRUNED" for t in trials)
    return {
        "trials": len(trials),
        "guided": len(guided),
        "pruned": pruned,
        "first_guided_generation": first,
    }


# -- the commands ---------------------------------------------------------------------------


def resolve_shape(args: argparse.Namespace) -> Shape:
    """The shape of ``--shape`` with ``--steps`` and ``--evo-steps`` applied.

    Raises:
        ValueError: ``--evo-steps`` does not divide ``--steps``.
    """
    shape = SHAPES[args.shape]
    if args.steps is not None:
        shape = replace(shape, steps=args.steps)
    if args.evo_steps is not None:
        shape = replace(shape, evo_steps=args.evo_steps)
    if shape.steps % shape.evo_steps or shape.evo_steps < 1:
        raise ValueError(
            f"--evo-steps ({shape.evo_steps}) must divide --steps ({shape.steps}): every "
            "strategy trains whole generations; pick a divisor"
        )
    if args.pbt:
        settings = yaml.safe_load(args.pbt)
        shape = replace(shape, pbt=settings)
    return shape


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # one core per campaign; --parallel campaigns at once
    return env


def compare(args: argparse.Namespace) -> list[dict]:
    """Run every strategy of every task for every seed, score the test split, then write the
    tables, the curves and the plots."""
    shape = resolve_shape(args)
    work = Path(args.work_dir).resolve()
    jobs, groups = [], {}
    for task in args.tasks:
        data = write_task_files(task, shape, work / "data" / task)
        model = warm_model(task, shape)
        for seed in range(args.seeds_from, args.seeds_from + args.seeds):
            for s in args.strategies:
                manifests = strategy_manifests(s, task, shape, model, data, args.device, seed)
                dirs = [
                    work / task / (f"{s}-s{seed}" if len(manifests) == 1 else f"{s}-s{seed}-r{i}")
                    for i in range(len(manifests))
                ]
                jobs += list(zip(manifests, dirs, strict=True))
                groups[(task, s, seed)] = dirs
    print(
        f"{len(jobs)} campaigns; {shape.slots} x {shape.steps} member-steps per strategy",
        flush=True,
    )
    start = time.monotonic()
    jobs.sort(key=lambda job: _seed_of(job[1]))  # seed by seed: a deadline leaves whole seeds
    deadline = start + args.deadline_s if args.deadline_s else math.inf
    run_campaigns(jobs, args.parallel, child_env(args.device), deadline)
    print(f"campaigns done in {time.monotonic() - start:.0f} s", flush=True)
    done = {
        seed
        for seed in range(args.seeds_from, args.seeds_from + args.seeds)
        if all(
            (d / "finished.json").exists()
            for (_, _, s), ds in groups.items()
            if s == seed
            for d in ds
        )
    }
    if len(done) < args.seeds:
        print(f"the deadline left {args.seeds - len(done)} seeds unrun; reporting {sorted(done)}")
    return report(args, shape, {k: v for k, v in groups.items() if k[2] in done})


def _seed_of(directory: Path) -> int:
    """The comparison seed in a campaign directory's name (``<strategy>-s<seed>[-r<run>]``)."""
    return int(directory.name.split("-s")[1].split("-")[0])


def report(args: argparse.Namespace, shape: Shape, groups: dict) -> list[dict]:
    """Score, tabulate and plot the finished campaigns of ``groups``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves, summaries = [], []
    for task in args.tasks:
        test = task_splits(task, shape)["test"]
        for (t, s, seed), dirs in groups.items():
            if t != task:
                continue
            for d in dirs:
                check = spent(d)
                (d / "spent.json").write_text(json.dumps(check))
            curve = read_curve(dirs, task, s, seed)
            curves.append(score(dirs, curve, test))
        target = args.target.get(task, math.nan) if isinstance(args.target, dict) else math.nan
        summary = summarize(curves, task, target)
        summary["tpe_trials"] = [
            tpe_trials(dirs[0], shape.startup_trials)
            for (t, s, _), dirs in sorted(groups.items())
            if t == task and s == "tpe"
        ]
        summaries.append(summary)
        print(f"\n## {task}\n\n{format_summary(summary)}\n", flush=True)
    stem = out / f"proof_{args.shape}"
    stem.with_suffix(".json").write_text(
        json.dumps(
            {"shape": asdict(shape), "curves": [asdict(c) for c in curves], "summaries": summaries},
            default=str,
        )
    )
    stem.with_suffix(".md").write_text(
        "\n\n".join(f"## {s['task']}\n\n{format_summary(s)}" for s in summaries) + "\n"
    )
    try:
        plot(stem.with_suffix(".json"))
    except ModuleNotFoundError as err:  # a GPU machine without the bench extra
        print(f"no plots ({err}); draw them where matplotlib is: plot {stem}.json", flush=True)
    return summaries


def plot(results: Path) -> list[Path]:
    """The reward-vs-compute plot of each task in a ``compare`` result file, beside it."""
    data = json.loads(Path(results).read_text())
    curves = [Curve(**c) for c in data["curves"]]
    paths = []
    for summary in data["summaries"]:
        task = summary["task"]
        path = Path(results).with_name(f"{Path(results).stem}_{task}.png")
        paths.append(plot_curves(curves, task, float(summary["target"]), path))
    return paths


def merged(args: argparse.Namespace) -> None:
    """``compare`` result files of one shape as one (``--out`` is the merged file's path):
    the tables and plots over all their seeds."""
    out = Path(args.out)
    if out.suffix != ".json":
        raise SystemExit(f"merge: --out {out} must name the merged .json file")
    data = merge([Path(f) for f in args.files], args.target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, default=str))
    text = "\n\n".join(f"## {s['task']}\n\n{format_summary(s)}" for s in data["summaries"])
    out.with_suffix(".md").write_text(text + "\n")
    print(text, flush=True)
    print("\n".join(map(str, plot(out))))


def envelopes(args: argparse.Namespace) -> None:
    """For each sweep file: the best eval reward of any fixed configuration after each
    generation, and the member-steps before one of them reaches the task's ``--target`` when
    it runs in all ``--slots`` slots (the least any strategy that keeps one configuration
    spends, lineages being as deep as the member-steps spent over the slots)."""
    slots = resolve_shape(args).slots
    for path in map(Path, args.files):
        task = path.stem.split("_", 2)[2]
        if task not in args.target:
            raise SystemExit(f"envelope: no --target for {task} (e.g. --target {task}=0.6)")
        e = envelope(path, args.target[task], slots)
        best = " ".join(f"{d}:{r:.3f}" for d, r in zip(e["depths"], e["best"], strict=True))
        print(f"{task}: best of any configuration after each depth {best}")
        if e["depth"] is None:
            print(f"  no configuration reaches {args.target[task]:g}")
        else:
            print(
                f"  first at {args.target[task]:g}: {e['config']} after {e['depth']} steps; "
                f"{slots} slots of it reach it after {e['member_steps']} member-steps"
            )


def sweep(args: argparse.Namespace) -> None:
    """Sensitivity of one member to lr and temperature over the comparison's T steps: one
    campaign of one member per pair, its eval reward after every k steps."""
    shape = resolve_shape(args)
    work = Path(args.work_dir).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        data = write_task_files(task, shape, work / "data" / task)
        model = warm_model(task, shape)
        jobs = []
        for lr in args.lrs:
            for temp in args.temperatures:
                m = strategy_manifests("default", task, shape, model, data, args.device, 0)[0]
                m["optim"] = {"lr": lr}
                m["rollout"]["temperature"] = temp
                jobs.append(((lr, temp), m, work / task / "sweep" / f"lr{lr:g}-t{temp:g}"))
        run_campaigns([(m, d) for _, m, d in jobs], args.parallel, child_env(args.device))
        before = warm_reward(model, task_splits(task, shape)["eval"], args.device, task)
        grid = {}
        lines = [
            f"{task}: warm start {before:.3f} (eval split, greedy); eval reward after "
            f"{', '.join(str(shape.evo_steps * (g + 1)) for g in range(shape.generations))} steps",
        ]
        for key, _, d in jobs:
            grid[key] = _raw_rewards(d)
            lines.append(
                f"lr {key[0]:g} temperature {key[1]:g}: " + " ".join(f"{r:.3f}" for r in grid[key])
            )
        # the oracle: the configuration whose run's best member (by eval) is best, on the test split
        (lr, temp), _, best_dir = max(jobs, key=lambda job: max(grid[job[0]]))
        scored = test_reward(best_dir, task_splits(task, shape)["test"])
        lines.append(
            f"oracle: lr {lr:g} temperature {temp:g}, best eval {scored['eval_reward']:.3f}, test "
            f"{scored['reward']:.3f}; the sweep cost {len(jobs)} x {shape.steps} = "
            f"{len(jobs) * shape.steps} member-steps ({len(jobs) * shape.steps / (shape.slots * shape.steps):.2f}x a strategy's budget)"
        )
        text = "\n".join(lines)
        print(text, flush=True)
        (out / f"sweep_{args.shape}_{task}.txt").write_text(text + "\n")
        steps = [shape.evo_steps * (g + 1) for g in range(shape.generations)]
        plot_sweep(grid, steps, task, out / f"sweep_{args.shape}_{task}.png")


def _raw_rewards(directory: Path) -> list[float]:
    """A one-member campaign's eval reward after each generation (not the best so far)."""
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        members = sorted(store.members(), key=lambda m: m.generation)
    return [m.fitness_history[-1] for m in members if m.fitness_history]


def warm_reward(model: str, problems: list[tuple[str, str]], device: str, task: str) -> float:
    """Greedy exact-answer reward of ``model`` (no adapter) on ``problems``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pbt.algorithms.builtin.arithmetic import arithmetic_reward
    from pbt.algorithms.rollout.hf import chat_prompts

    tokenizer = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model).to(device).eval()
    enc = tokenizer(
        chat_prompts(tokenizer, [q for q, _ in problems]),
        return_tensors="pt",
        padding=True,
        padding_side="left",
        add_special_tokens=False,
    ).to(device)
    with torch.no_grad():
        out = net.generate(
            **enc,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return statistics.fmean(
        arithmetic_reward(t, a, q) for t, (q, a) in zip(texts, problems, strict=True)
    )


def _targets(text: str | None) -> dict[str, float]:
    """``addition=0.7,chain_sum=0.6`` as a dict."""
    if not text:
        return {}
    pairs = [item.split("=") for item in text.split(",")]
    return {k.strip(): float(v) for k, v in pairs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command", choices=["compare", "sweep", "plot", "merge", "envelope", "campaign"]
    )
    parser.add_argument(
        "files",
        nargs="*",
        help="campaign: the manifest to run; plot: a compare result file; merge: compare result "
        "files of one shape (--out names the merged file); envelope: sweep files (sweep_*.txt)",
    )
    parser.add_argument("--dir", help="campaign: its directory")
    parser.add_argument("--shape", default="cpu", choices=list(SHAPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--strategies", nargs="+", default=list(COMPARED), choices=STRATEGIES)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seeds-from", type=int, default=0, help="first seed")
    parser.add_argument("--steps", type=int, help="T; default: the shape's")
    parser.add_argument("--evo-steps", type=int, help="k; default: the shape's")
    parser.add_argument(
        "--pbt",
        help="YAML over the pbt strategy's sections, e.g. '{population: {selection: truncation}}'",
    )
    parser.add_argument(
        "--target", type=_targets, default={}, help="e.g. addition=0.7,chain_sum=0.6"
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=2,
        help="members training at once over all campaigns (a campaign counts its launch.slots)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        help="start no campaign after this many seconds; report the seeds that finished",
    )
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=[1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2]
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0, 1.4])
    parser.add_argument("--work-dir", default="runs/proof_of_value")
    parser.add_argument("--out", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        compare(args)
    elif args.command == "sweep":
        sweep(args)
    elif args.command == "plot":
        print("\n".join(map(str, plot(Path(args.files[0])))))
    elif args.command == "merge":
        merged(args)
    elif args.command == "envelope":
        envelopes(args)
    else:
        run_one(Path(args.files[0]), Path(args.dir))


if __name__ == "__main__":
    main()
