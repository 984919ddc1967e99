"""Proof of value III: on a real pretrained model, a task whose best hyperparameters change
during training, PBT against strong baselines, pre-registered (``bench/proof_v3_protocol.md``).

    python bench/proof_v3.py stage0 --seed 100 --part 0/2 --device cuda   # and 1/2; seeds 101, 102
    python bench/proof_v3.py stage0-report                                  # the gate
    python bench/proof_v3.py seed --task S --seed 0 --shape h200 --device cuda
    python bench/proof_v3.py analyse --task S
    python bench/proof_v3.py replay --task S --seed 0 --grid bench/results/proof_v3/stage0.json
    python bench/proof_v3.py seed --task S --seed 0 --shape micro --device cpu --strategies pbt,default  # CPU

``seed`` runs every strategy of one task and one seed in one invocation, on one machine (so the
pairing holds), campaigns side by side (``--parallel`` members at once, one MPS daemon shared
by all of them on a GPU), and writes ``<out>/<task>-s<seed>.json``: per strategy the test
macro accuracy of its best member by eval, per difficulty, its member-steps, wall seconds and
the anytime curve (best eval so far after each generation against member-steps). Strategies,
each with ``slots x steps`` member-steps unless said (``--strategies`` picks some):

- ``pbt``: truncation (a quarter), a burn-in of 2 generations, the original PBT's explore
  (every searched value of a copy x0.8 / x1.25, each resampled with probability 0.25).
- ``mfpbt``: multi-frequency selection (2 groups, evolving every 1 and 3 generations), the same
  explore.  ``pb2``: truncation with PB2's GP-bandit explore.
- ``random`` / ``random_cosine``: ``slots`` trials of ``steps`` steps, constant / cosine lr.
- ``asha_tpe``: TPE trials with successive halving.
- ``grid_fixed``: the best fixed configuration (schedule family included) of Stage 0's grid on
  the calibration seeds, one run (the grid's cost is reported by ``stage0-report``).
- ``hand_schedule`` (Task S): an expert who knows the stages: the lr restarts at each stage's
  first step and decays by a cosine within it; one run in library mode (``Member``).
- ``default``: the library's defaults, one run. ``manual3``: a practitioner's three learning
  rates with cosine decay, three runs, the best by eval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from proof_of_value import read_curve, run_campaigns, spent  # noqa: E402
from proof_stats import holm, paired_comparison  # noqa: E402
from proof_v3_tasks import TASKS, stage_ends, task_section, task_splits  # noqa: E402

STRATEGIES = (
    "pbt", "mfpbt", "pb2", "random", "random_cosine", "asha_tpe", "grid_fixed",
    "hand_schedule", "default", "manual3",
)  # fmt: skip
PRIMARY = ("random_cosine", "asha_tpe", "grid_fixed")
"""PBT's three pre-registered comparisons (Holm over these)."""
CALIBRATION_SEEDS = (100, 101, 102)
GATE = {"schedule_gain": 0.05, "random_gap": 0.03, "saturated": 0.90}
"""Stage 0: best schedule - best constant >= 0.05; grid_fixed - random's best of 8 >= 0.03;
the best configuration's test accuracy below 0.90 at T."""
FUTILITY_UPPER = 0.02
"""After 5 test seeds: stop when every primary comparison's paired t 95% upper bound is below
this (PBT cannot lead by a meaningful margin)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """The model and the sizes of one seed's run."""

    model: str = "builtin:smollm2-135m-instruct"
    slots: int = 8
    steps: int = 48
    evo_steps: int = 6
    eval_size: int = 1024
    test_size: int = 4096
    group_size: int = 8
    prompts_per_step: int = 16
    max_tokens: int = 16
    lora: dict = field(default_factory=lambda: {"r": 16, "alpha": 32})
    launch: dict = field(default_factory=dict)
    parallel: int = 32
    """Members training at once over all campaigns of a seed."""

    @property
    def generations(self) -> int:
        return self.steps // self.evo_steps


SHAPES = {
    "h200": Shape(
        launch={"gpus_per_member": 1, "members_per_gpu": 8, "mps": True, "slots": 8},
    ),
    # the fallback if Stage 0 measures a seed of "h200" above 9 minutes
    "h200_lite": Shape(
        steps=36,
        eval_size=513,
        test_size=2049,
        launch={"gpus_per_member": 1, "members_per_gpu": 8, "mps": True, "slots": 8},
    ),
    # the CPU dry run: the untrained tiny model, seconds per campaign
    "micro": Shape(
        model="builtin:tiny",
        slots=6,
        steps=6,
        evo_steps=2,
        eval_size=6,
        test_size=6,
        group_size=2,
        prompts_per_step=2,
        max_tokens=4,
        lora={"r": 4, "alpha": 8},
        launch={"slots": 2},
        parallel=2,
    ),
}

RANGES = {
    "lr": {"min": 2.0e-5, "max": 2.0e-3, "log": True},
    "temperature": {"min": 0.6, "max": 1.3},
    "beta": {"min": 0.0, "max": 0.1},
    "clip_high": {"min": 0.2, "max": 0.4},
    "max_grad_norm": {"min": 0.3, "max": 3.0, "log": True},
}
"""The search space of every searching strategy."""
EXPLORE = {"no_mutation": 0.0, "rl_hp": 1.0, "perturb": "all", "resample_probability": 0.25}
MANUAL_LRS = (1.0e-4, 3.0e-4, 1.0e-3)
GRID = [
    {"lr": lr, "schedule": schedule, "temperature": temperature}
    for lr in (3.0e-5, 1.0e-4, 3.0e-4, 1.0e-3, 3.0e-3)
    for schedule in ("constant", "cosine")
    for temperature in (0.7, 1.0)
]
"""Stage 0's grid: 20 fixed configurations, two schedule families."""


# -- manifests ------------------------------------------------------------------------------


def base_manifest(task: str, shape: Shape, seed: int, device: str, data: Path) -> dict:
    """What every strategy's manifest shares."""
    gpu = device == "cuda"
    launch = {"slots": 1, "gpus_per_member": int(gpu), "persistent_workers": True}
    ranges = {k: v | {"grow_factor": 1.25, "shrink_factor": 0.8} for k, v in RANGES.items()}
    return {
        "model": {"name": shape.model},
        "lora": dict(shape.lora),
        "optim": {"lr": 3.0e-4},
        "algorithm": {
            "group_size": shape.group_size,
            "prompts_per_step": shape.prompts_per_step,
            "beta": 0.0,
            "collapse_patience": None,
        },
        "rollout": {"max_output_tokens": shape.max_tokens, "temperature": 1.0},
        "task": task_section(task, shape.steps, shape.eval_size, shape.test_size, data),
        "training": {"seed": seed, "device": device, "steps": shape.steps, "output_dir": "m"},
        "population": {"size": shape.slots, "evo_steps": shape.evo_steps},
        "mutation": {"ranges": ranges},
        "budget": {"generations": shape.generations},
        "launch": launch | shape.launch,
        "tracking": {"enabled": False},
    }


def single(m: dict, seed: int, lr: float | None, schedule: str, temperature: float) -> dict:
    """A one-member, never-mutated campaign of ``m`` with these values (None: the defaults)."""
    one = json.loads(json.dumps(m))
    one["training"]["seed"] = seed
    one["population"] = {"size": 1, "tournament_size": 1, "evo_steps": m["population"]["evo_steps"]}
    one["mutation"] = {"no_mutation": 1.0, "rl_hp": 0.0}
    one["launch"] = m["launch"] | {"slots": 1}
    if lr is None:  # the library's own defaults
        one.pop("optim")
        one["rollout"].pop("temperature")
        return one
    one["optim"] = {"lr": lr, "schedule": schedule}
    one["rollout"]["temperature"] = temperature
    return one


def strategy_manifests(strategy: str, m: dict, seed: int, grid_best: dict | None) -> list[dict]:
    """The campaigns of one strategy (several for ``manual3``; none for ``hand_schedule``)."""
    slots, generations = m["population"]["size"], m["budget"]["generations"]
    search = json.loads(json.dumps(m))
    if strategy in ("pbt", "mfpbt", "pb2"):
        search["population"] |= {"init_sampler": "random"}
        search["mutation"] |= EXPLORE
        if strategy == "mfpbt":
            search["population"] |= {"selection": "multi_frequency", "frequencies": [1, 3]}
        else:
            search["population"] |= {"selection": "truncation", "ready_generations": 2}
        if strategy == "pb2":
            search["search"] = {"strategy": "pb2"}
        return [search]
    if strategy in ("random", "random_cosine", "asha_tpe"):
        search["search"] = {
            "strategy": "optuna",
            "sampler": "tpe" if strategy == "asha_tpe" else "random",
            "pruner": "successive_halving" if strategy == "asha_tpe" else "none",
            "trial_generations": generations,
            "startup_trials": max(1, slots // 2),
        }
        if strategy == "random_cosine":
            search["optim"] = {"lr": 3.0e-4, "schedule": "cosine"}
        return [search]
    if strategy == "grid_fixed":
        if grid_best is None:
            raise ValueError("grid_fixed needs Stage 0's result: pass --grid <stage0.json>")
        return [single(m, seed, grid_best["lr"], grid_best["schedule"], grid_best["temperature"])]
    if strategy == "default":
        return [single(m, seed, None, "constant", 1.0)]
    if strategy == "manual3":
        return [single(m, seed * 10 + i, lr, "cosine", 1.0) for i, lr in enumerate(MANUAL_LRS)]
    if strategy == "hand_schedule":
        return []
    raise ValueError(f"strategy ({strategy!r}) must be one of {', '.join(STRATEGIES)}")


# -- scoring --------------------------------------------------------------------------------

_MEMBERS: dict[str, object] = {}


def _member(manifest_dict: dict, base_dir: str):
    """A loaded member for the task and model of ``manifest_dict``, kept for later scoring."""
    import torch

    from pbt.algorithms.runtime.member import Member
    from pbt.config.read.loader import manifest_from_dict

    manifest = manifest_from_dict(manifest_dict, base_dir=base_dir)
    key = json.dumps([manifest_dict[k] for k in ("model", "lora", "task")], sort_keys=True)
    if key not in _MEMBERS:
        _MEMBERS[key] = Member(manifest, torch.device(manifest.training.device))
    return _MEMBERS[key], manifest


def macro_accuracy(member, splits: list[dict], which: str = "test") -> dict:
    """Greedy exact match of ``member`` on each difficulty's ``which`` rows, and their mean."""
    from pbt.algorithms.data.tasks import Example

    by = [
        member.learner.evaluate([Example(q, a) for q, a in s[which]], member.task.reward, 0.0)
        for s in splits
    ]
    return {"macro": sum(by) / len(by), "by_difficulty": by}


def best_of(directories: list[Path], splits: list[dict]) -> dict:
    """The best member by eval over ``directories``' campaigns, scored on the test rows."""
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    best = None
    for directory in directories:
        with CampaignStore(directory / STORE_FILENAME) as store:
            member_id, eval_fitness = store.best()
            checkpoint = store.member(member_id).checkpoint
            config = store.load_config()
        if best is None or eval_fitness > best[1]:
            best = (directory, eval_fitness, member_id, checkpoint, config)
    assert best is not None
    directory, eval_fitness, member_id, checkpoint, config = best
    member, _ = _member(config["manifest"], config["base_dir"])
    member.load(directory / checkpoint)
    return {"member": member_id, "eval": eval_fitness} | macro_accuracy(member, splits)


def scheduled_run(
    one: dict, steps: int, splits: list[dict], values_at: Callable[[int], dict] | None = None
) -> dict:
    """One member of manifest ``one`` trained ``steps`` steps in library mode (``Member``),
    ``values_at(step)`` (hyperparameters by name, or None) applied before each step; scored on
    the eval and test rows."""
    import torch

    from pbt.algorithms.runtime.member import Member
    from pbt.config.read.loader import manifest_from_dict

    manifest = manifest_from_dict(one, base_dir=".")
    member = Member(manifest, torch.device(manifest.training.device))
    began = time.monotonic()
    for step in range(steps):
        if values_at is not None:
            member.learner.apply_hyperparameters(values_at(step))
        member.learner.train_step(member.task.train, member.task.reward)
    wall = time.monotonic() - began
    held = macro_accuracy(member, splits, "eval")["macro"]
    scored = macro_accuracy(member, splits)
    return {"eval": held, "member_steps": steps, "wall_s": wall} | scored


def generation_seconds(directories: list[Path]) -> list[float]:
    """Seconds from the first campaign's creation to each generation's commit (campaigns of one
    strategy run side by side: the latest of them at each generation), the anytime curve's
    time axis."""
    import sqlite3
    from datetime import datetime

    from pbt.controller.store import STORE_FILENAME

    by_generation: dict[int, float] = {}
    for directory in directories:
        db = sqlite3.connect(directory / STORE_FILENAME)
        rows = dict(db.execute("SELECT generation, committed_at FROM generations"))
        db.close()
        start = datetime.fromisoformat(rows.pop(-1))
        for generation, at in rows.items():
            seconds = (datetime.fromisoformat(at) - start).total_seconds()
            by_generation[generation] = max(by_generation.get(generation, 0.0), seconds)
    return [by_generation[g] for g in sorted(by_generation)]


def hand_schedule(m: dict, shape: Shape, seed: int, splits: list[dict], peak: float) -> dict:
    """The expert's run: the lr restarts at ``peak`` at each stage's first step and decays by a
    cosine to a tenth within the stage; temperature 1.0; library mode, one member."""
    starts = [0, *stage_ends(shape.steps)]
    ends = [*starts[1:], shape.steps]

    def values_at(step: int) -> dict:
        stage = max(i for i, s in enumerate(starts) if step >= s)
        progress = (step - starts[stage]) / max(1, ends[stage] - starts[stage])
        return {"lr": peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))}

    one = single(m, seed, peak, "constant", 1.0)
    return scheduled_run(one, shape.steps, splits, values_at)


def trajectory(directory: Path) -> list[dict]:
    """The hyperparameters of a campaign's best member's lineage, one dict per generation (what
    each of its ancestors trained with), generation 0 first."""
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        members = {x.member_id: x for x in store.members()}
        member_id, _ = store.best()
    chain = []
    record = members[member_id]
    while record is not None:
        chain.append(dict(record.hyperparameters))
        record = members.get(record.parent_id) if record.parent_id else None
    return chain[::-1]


def replay(args: argparse.Namespace) -> dict:
    """Schedule replay: the best ``pbt`` member's trajectory of seed ``args.seed`` replayed from
    the start on new training seeds, against ``grid_fixed`` on the same seeds (both in library
    mode); written to ``<out>/replay-<task>-s<seed>.json``."""
    shape = SHAPES[args.shape]
    work = Path(args.work_dir).resolve() / args.task / f"s{args.seed}"
    values = trajectory(work / "pbt-0")
    grid = json.loads(Path(args.grid).read_text())["grid_fixed"]
    splits = task_splits(args.task, shape.eval_size, shape.test_size)
    out = {"task": args.task, "seed": args.seed, "trajectory": values, "runs": []}
    for seed in args.replay_seeds:
        m = base_manifest(args.task, shape, seed, args.device, work / "replay-data")
        one = single(m, seed, values[0]["lr"], "constant", values[0].get("temperature", 1.0))
        replayed = scheduled_run(
            one,
            shape.steps,
            splits,
            lambda step: values[min(step // shape.evo_steps, len(values) - 1)],
        )
        fixed = single(m, seed, grid["lr"], grid["schedule"], grid["temperature"])
        out["runs"].append(
            {
                "seed": seed,
                "replay": replayed,
                "grid_fixed": scheduled_run(fixed, shape.steps, splits),
            }
        )
        print(
            f"seed {seed}: replay {replayed['macro']:.3f}, grid_fixed {out['runs'][-1]['grid_fixed']['macro']:.3f}"
        )
    path = Path(args.out) / f"replay-{args.task}-s{args.seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


# -- one seed -------------------------------------------------------------------------------


def run_seed(args: argparse.Namespace) -> dict:
    """Every strategy of ``args.task`` for ``args.seed``, scored; written to the out folder."""
    shape = SHAPES[args.shape]
    work = Path(args.work_dir).resolve() / args.task / f"s{args.seed}"
    m = base_manifest(args.task, shape, args.seed, args.device, work / "data")
    splits = task_splits(args.task, shape.eval_size, shape.test_size)
    grid_best = json.loads(Path(args.grid).read_text())["grid_fixed"] if args.grid else None
    strategies = [s for s in args.strategies if not (s == "hand_schedule" and args.task != "S")]
    jobs, groups = [], {}
    for s in strategies:
        manifests = strategy_manifests(s, m, args.seed, grid_best)
        dirs = [work / f"{s}-{i}" for i in range(len(manifests))]
        jobs += list(zip(manifests, dirs, strict=True))
        groups[s] = dirs
    began = time.monotonic()
    with shared_mps(args.device):
        run_campaigns(jobs, args.parallel or shape.parallel, child_env(args.device))
    results = {"task": args.task, "seed": args.seed, "shape": args.shape, "strategies": {}}
    results["campaigns_wall_s"] = time.monotonic() - began
    for s, dirs in groups.items():
        if not dirs:
            continue
        curve = read_curve(dirs, args.task, s, args.seed)
        steps = sum(spent(d)["member_steps"] for d in dirs)
        results["strategies"][s] = best_of(dirs, splits) | {
            "member_steps": steps,
            "wall_s": curve.wall_s,
            "curve": {
                "member_steps": curve.steps,
                "best_eval": curve.reward,
                "seconds": generation_seconds(dirs),
            },
        }
    if "hand_schedule" in strategies:
        peak = grid_best["lr"] if grid_best else 3.0e-4
        results["strategies"]["hand_schedule"] = hand_schedule(m, shape, args.seed, splits, peak)
    results["wall_s"] = time.monotonic() - began
    out = Path(args.out) / f"{args.task}-s{args.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(format_seed(results), flush=True)
    return results


def format_seed(results: dict) -> str:
    rows = [
        "| strategy | test macro | by difficulty | eval | member-steps | wall s |",
        "|---" * 6 + "|",
    ]
    for s, r in results["strategies"].items():
        by = " / ".join(f"{v:.3f}" for v in r["by_difficulty"])
        rows.append(
            f"| {s} | {r['macro']:.3f} | {by} | {r['eval']:.3f} | {r['member_steps']} | "
            f"{r['wall_s']:.0f} |"
        )
    return f"{results['task']} seed {results['seed']} ({results['wall_s']:.0f} s)\n" + "\n".join(
        rows
    )


class shared_mps:
    """One MPS daemon for every campaign of a seed on a GPU (each campaign uses the daemon its
    environment names); nothing on a CPU."""

    def __init__(self, device: str) -> None:
        self.daemon = None
        self.device = device

    def __enter__(self):
        if self.device == "cuda":
            from pbt.launch.mps import MpsDaemon

            self.daemon = MpsDaemon().start()
            os.environ.update(self.daemon.env)
            if self.daemon.note:
                print(self.daemon.note, flush=True)
        return self

    def __exit__(self, *_) -> None:
        if self.daemon is not None:
            keys = list(self.daemon.env)
            self.daemon.stop()
            for key in keys:  # the harness's own CUDA work then runs without the daemon
                os.environ.pop(key, None)


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


# -- Stage 0 --------------------------------------------------------------------------------


def stage0_grid(shape_name: str) -> list[dict]:
    """Stage 0's grid for a shape (the dry run's: three of its configurations)."""
    return GRID if shape_name != "micro" else GRID[::7]


def stage0(args: argparse.Namespace) -> dict:
    """One calibration seed of Task S, or part ``k/n`` of it (grid configurations k, k + n, ...;
    part 0 also the base model's accuracy per difficulty, random search's best of ``slots``
    trials and the expert's schedule): every grid configuration one run, scored on the test
    rows; written to ``<out>/stage0-s<seed>-p<k>of<n>.json``."""
    shape = SHAPES[args.shape]
    part, parts = (int(x) for x in args.part.split("/"))
    work = Path(args.work_dir).resolve() / "stage0" / f"s{args.seed}"
    m = base_manifest("S", shape, args.seed, args.device, work / "data")
    splits = task_splits("S", shape.eval_size, shape.test_size)
    grid = stage0_grid(args.shape)
    mine = list(range(part, len(grid), parts))
    jobs = [
        (
            single(m, args.seed, grid[i]["lr"], grid[i]["schedule"], grid[i]["temperature"]),
            work / f"grid-{i}",
        )
        for i in mine
    ]
    if part == 0:
        jobs += [(strategy_manifests("random", m, args.seed, None)[0], work / "random-0")]
    began = time.monotonic()
    with shared_mps(args.device):
        run_campaigns(jobs, args.parallel or shape.parallel, child_env(args.device))
    out = {"seed": args.seed, "shape": args.shape, "part": args.part, "grid": {}}
    out["campaigns_wall_s"] = time.monotonic() - began
    if part == 0:
        member, _ = _member(m, str(work))
        out["step0"] = macro_accuracy(member, splits, "eval")
    for i, (_, directory) in zip(mine, jobs, strict=False):
        steps = spent(directory)["member_steps"]
        wall = json.loads((directory / "finished.json").read_text())["wall_s"]
        scored = best_of([directory], splits) | {"member_steps": steps, "wall_s": wall}
        out["grid"][str(i)] = grid[i] | scored
    if part == 0:
        out["random"] = best_of([work / "random-0"], splits)
        out["hand_schedule"] = hand_schedule(m, shape, args.seed, splits, args.peak)
    out["wall_s"] = time.monotonic() - began
    path = Path(args.out) / f"stage0-s{args.seed}-p{part}of{parts}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"stage 0 seed {args.seed} part {args.part}: {out['wall_s']:.0f} s", flush=True)
    return out


def _stage0_runs(folder: Path) -> list[dict]:
    """Each calibration seed's parts merged into one run; a seed missing a part is named."""
    by_seed: dict[int, dict] = {}
    for path in sorted(folder.glob("stage0-s*-p*.json")):
        part = json.loads(path.read_text())
        run = by_seed.setdefault(
            part["seed"], {"seed": part["seed"], "shape": part["shape"], "grid": {}, "wall_s": 0.0}
        )
        run["grid"] |= part["grid"]
        run["wall_s"] += part["wall_s"]
        run |= {k: part[k] for k in ("step0", "random", "hand_schedule") if k in part}
    runs = []
    for seed, run in sorted(by_seed.items()):
        missing = len(stage0_grid(run["shape"])) - len(run["grid"])
        if missing or "random" not in run:
            raise SystemExit(
                f"stage 0 seed {seed} lacks {missing} grid runs or part 0; run them first"
            )
        run["grid"] = [run["grid"][str(i)] for i in range(len(run["grid"]))]
        runs.append(run)
    return runs


def stage0_report(args: argparse.Namespace) -> dict:
    """The gate over the calibration seeds' results: the table and the decision, written to
    ``<out>/stage0.json`` (its ``grid_fixed`` is the configuration the comparison runs)."""
    runs = _stage0_runs(Path(args.out))
    if not runs:
        raise SystemExit(f"no stage0-s*.json in {args.out}: run stage0 --seed N first")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    configs = []
    for i, g in enumerate(runs[0]["grid"]):
        values = {k: g[k] for k in ("lr", "schedule", "temperature")}
        configs.append(values | {"test": mean([r["grid"][i]["macro"] for r in runs])})
    constant = max((c for c in configs if c["schedule"] == "constant"), key=lambda c: c["test"])
    hand = mean([r["hand_schedule"]["macro"] for r in runs])
    schedules = [c for c in configs if c["schedule"] != "constant"]
    schedules.append({"lr": "stagewise", "schedule": "hand", "temperature": 1.0, "test": hand})
    best_schedule = max(schedules, key=lambda c: c["test"])
    best_fixed = max(configs, key=lambda c: c["test"])
    random_best = mean([r["random"]["macro"] for r in runs])
    checks = {
        "schedule_gain": best_schedule["test"] - constant["test"],
        "random_gap": best_fixed["test"] - random_best,
        "best": max(best_fixed["test"], hand),
    }
    passed = {
        "schedule_gain": checks["schedule_gain"] >= GATE["schedule_gain"],
        "random_gap": checks["random_gap"] >= GATE["random_gap"],
        "not_saturated": checks["best"] < GATE["saturated"],
    }
    grid_cost = sum(g["member_steps"] for r in runs for g in r["grid"])
    report = {
        "seeds": [r["seed"] for r in runs],
        "configs": configs,
        "best_constant": constant,
        "best_schedule": best_schedule,
        "grid_fixed": best_fixed,
        "random_best_of_slots": random_best,
        "step0": [r["step0"] for r in runs],
        "checks": checks,
        "passed": passed,
        "decision": "run the comparison" if all(passed.values()) else "redesign the task",
        "grid_cost_member_steps": grid_cost,
        "wall_s": [r["wall_s"] for r in runs],
    }
    Path(args.out, "stage0.json").write_text(json.dumps(report, indent=1))
    lines = ["| lr | schedule | temperature | test macro (mean over seeds) |", "|---|---|---|---|"]
    lines += [
        f"| {c['lr']} | {c['schedule']} | {c['temperature']} | {c['test']:.3f} |" for c in configs
    ]
    lines.append(f"| stagewise | hand | 1.0 | {hand:.3f} |")
    print("\n".join(lines))
    print(f"random best of {SHAPES[runs[0]['shape']].slots}: {random_best:.3f}")
    for key, ok in passed.items():
        print(
            f"{key}: {'pass' if ok else 'FAIL'} ({checks[key if key in checks else 'best']:+.3f})"
        )
    print(f"decision: {report['decision']}; grid cost {grid_cost} member-steps")
    return report


# -- analysis -------------------------------------------------------------------------------


def analyse(args: argparse.Namespace) -> dict:
    """The pre-registered analysis of one task over its test seeds' result files."""
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.out).glob(f"{args.task}-s*.json"))]
    runs = [r for r in runs if r["seed"] not in CALIBRATION_SEEDS]
    by = {}
    for r in runs:
        for s, v in r["strategies"].items():
            by.setdefault(s, {})[r["seed"]] = v["macro"]
    pbt = by.get("pbt", {})
    primary = {s: paired_comparison(pbt, by.get(s, {})) for s in PRIMARY}
    p = {s: c["wilcoxon_p"] for s, c in primary.items() if c["n"]}
    for s, adjusted in holm(p).items():
        primary[s]["holm_p"] = adjusted
    secondary = {s: paired_comparison(pbt, v) for s, v in by.items() if s not in (*PRIMARY, "pbt")}
    futile = len(pbt) >= 5 and all(
        c["n"] and c["t95"][1] < FUTILITY_UPPER for c in primary.values()
    )
    report = {
        "task": args.task,
        "seeds": sorted(pbt),
        "primary": primary,
        "secondary": secondary,
        "futile": futile,
    }
    Path(args.out, f"analysis-{args.task}.json").write_text(json.dumps(report, indent=1))
    print(f"{args.task}: {len(pbt)} seeds; futility rule met: {futile}")
    for s, c in {**primary, **secondary}.items():
        if c["n"]:
            w, t, lo = c["wins_ties_losses"]
            holm_p = f", Holm p {c['holm_p']:.3f}" if "holm_p" in c else ""
            print(
                f"pbt - {s}: {c['mean']:+.3f} [{c['t95'][0]:+.3f}, {c['t95'][1]:+.3f}], "
                f"Wilcoxon p {c['wilcoxon_p']:.3f}{holm_p}, W/T/L {w}/{t}/{lo}"
            )
    return report


# -- the command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["seed", "stage0", "stage0-report", "analyse", "replay"])
    parser.add_argument("--task", choices=TASKS, default="S")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="h200")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--strategies", type=lambda t: t.split(","), default=list(STRATEGIES))
    parser.add_argument("--grid", help="seed: Stage 0's stage0.json (for grid_fixed)")
    parser.add_argument("--peak", type=float, default=3.0e-4, help="stage0: the expert's peak lr")
    parser.add_argument("--part", default="0/1", help="stage0: k/n, the part of the grid to run")
    parser.add_argument("--parallel", type=int, default=0, help="members at once (0: the shape's)")
    parser.add_argument(
        "--replay-seeds",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[200, 201, 202],
        help="replay: the new training seeds",
    )
    parser.add_argument("--work-dir", default="runs/proof_v3")
    parser.add_argument("--out", default=str(BENCH / "results" / "proof_v3"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        raise SystemExit(f"--strategies ({sorted(unknown)}) must be of {', '.join(STRATEGIES)}")
    if args.command in ("seed", "replay") and not args.grid and "grid_fixed" in args.strategies:
        raise SystemExit(
            f"{args.command} needs Stage 0's choice for grid_fixed: pass --grid <out>/stage0.json "
            "(from stage0-report), or leave grid_fixed out of --strategies"
        )
    commands = {
        "seed": run_seed,
        "stage0": stage0,
        "stage0-report": stage0_report,
        "analyse": analyse,
        "replay": replay,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
