"""PBT against fixed hyperparameters, random search and Optuna TPE, on the same compute budget.

    python bench/pbt_vs_search.py calibrate                  # warm start's reward; RL's gain
    python bench/pbt_vs_search.py compare --seeds 3          # the comparison (CPU, tiny shape)
    python bench/pbt_vs_search.py compare --population 8 --resample-probability 0.25 \
        --target 0.65 --work-dir runs/pbt_vs_search_p8       # population 8, lr can jump
    python bench/pbt_vs_search.py compare --device cuda --shape h200 --seeds 3 --parallel 1

The task is ``builtin:addition`` ("What is 47 + 38?", exact-answer reward on a fixed held-out
split) from a model trained from scratch by a short supervised warm start
(:mod:`pbt.algorithms.builtin.addition`), then GRPO on LoRA adapters. Every strategy is a real campaign
(``pbt run`` on its own directory and SQLite store, members as worker processes):

- ``pbt``: a population of ``--population``, tournament selection, elitism and mutation of
  ``lr`` and ``temperature`` every generation (x1.2 / x0.8, or with
  ``--resample-probability`` a fresh draw from the range); generation 0 drawn at random.
- ``random``: the Optuna strategy, sampler ``random``, pruner ``none``: each slot trains a
  trial from scratch for ``trial_generations``, then starts a new one.
- ``tpe``: the Optuna strategy, sampler ``tpe``, pruner ``median``.
- ``fixed``: one member with the hand-picked hyperparameters of the shape, never mutated.

**Equal compute.** Every campaign trains exactly the same number of member-steps: the three
searches run ``population`` slots for ``generations`` generations of ``evo_steps`` steps, the
fixed configuration one member for ``population * generations`` generations. A member-step is
the same work whatever the strategy (the same batch of prompts and completions, the same
model), and every member task ends with the same held-out evaluation and checkpoint save. The
campaign's own seconds counter (``budget.gpu_hours``) counts GPU-seconds and reads 0 on a CPU,
so the harness also sums each member task's measured seconds (``result.json``: training,
evaluation, checkpoint) and reports them beside the member-steps.

**Reward vs compute.** After each generation a strategy's reward is the best held-out reward of
any member trained so far (what a user of that strategy would keep); its compute is the
member-steps (and seconds) spent so far. The final reward is that value at the end of the
budget; the compute to the target is where it first reaches ``--target``.

**Test split.** The held-out reward above selects members (PBT's tournaments, Optuna's pruning,
the best so far) and is therefore optimistic. Every strategy's final figure is also scored on a
test split no strategy ever sees: the last ``test_size`` problems of the task's held-out reserve,
disjoint from the eval split (its first ``eval_size``). The member scored is the campaign's
best by eval reward, loaded from its checkpoint and evaluated greedily by the members' own
evaluation code, the same way for every strategy.
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

STRATEGIES = ("pbt", "random", "tpe", "fixed")


@dataclass(frozen=True, slots=True)
class Shape:
    """A model size and the campaign sizes that go with it."""

    warm_model: dict[str, object] = field(default_factory=dict)
    """Qwen2 config fields over the tiny model's (empty: the tiny model)."""
    warm_steps: int = 375
    """Supervised warm-start steps: the model must stay well short of its ceiling."""
    population: int = 4
    generations: int = 8
    evo_steps: int = 5
    trial_generations: int = 4
    """Generations one Optuna trial trains at most."""
    eval_size: int = 256
    test_size: int = 256
    """Problems of the held-out reserve's tail that score the final members (see
    :func:`split_for_test`); never used for selection."""
    group_size: int = 8
    prompts_per_step: int = 8
    fixed_lr: float = 5e-4
    """The hand-picked configuration: the best lr of ``calibrate``."""
    fixed_temperature: float = 1.0
    resample_probability: float = 0.0
    """PBT: chance a mutated hyperparameter is drawn afresh from its range instead of scaled."""
    target: float = 0.55
    """The reward to reach, set from ``calibrate`` before any comparison ran: the warm start's
    reward plus half the gain of the hand-picked configuration in one member's run."""


SHAPES: dict[str, Shape] = {
    # 2-core CPU: one member's whole run (generations x evo_steps steps) is about a minute.
    "tiny": Shape(),
    # H200: a 8-layer, 512-wide model; calibrate (warm_steps, fixed_lr, target) before use.
    "h200": Shape(
        warm_model={
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
        },
        warm_steps=300,
        population=8,
        generations=10,
        evo_steps=10,
        trial_generations=5,
        eval_size=512,
        group_size=16,
        prompts_per_step=16,
    ),
}

RANGES = {
    "lr": {"min": 1.0e-4, "max": 3.0e-2, "log": True},
    "temperature": {"min": 0.5, "max": 1.5},
}
"""The search space, the same for every strategy."""


# -- manifests ------------------------------------------------------------------------------


def base_manifest(shape: Shape, model: str, device: str, seed: int, tracking: bool = False) -> dict:
    """What every strategy's manifest shares: model, task, algorithm, evaluation."""
    return {
        "model": {"name": model},
        "lora": {"r": 8, "alpha": 16},
        "optim": {"lr": shape.fixed_lr},
        "algorithm": {
            "group_size": shape.group_size,
            "prompts_per_step": shape.prompts_per_step,
            "beta": 0.0,
        },
        "rollout": {"temperature": shape.fixed_temperature, "max_output_tokens": 5},
        "task": {"name": "builtin:addition", "eval_size": shape.eval_size, "train_size": 100_000},
        "training": {"seed": seed, "device": device, "output_dir": "member"},
        "population": {
            "size": shape.population,
            "tournament_size": 2,
            "elitism": True,
            "evo_steps": shape.evo_steps,
            "init_sampler": "random",
        },
        "mutation": {
            "no_mutation": 0.2,
            "rl_hp": 0.8,
            "resample_probability": shape.resample_probability,
            "ranges": RANGES,
        },
        "budget": {"generations": shape.generations},
        "launch": {
            "slots": 1,
            "gpus_per_member": 1 if device == "cuda" else 0,
            "persistent_workers": True,
        },
        "tracking": {"enabled": tracking},
    }


def strategy_manifest(
    strategy: str, shape: Shape, model: str, device: str, seed: int, tracking: bool = False
) -> dict:
    """The manifest of one strategy; all of them train the same member-steps. ``tracking``
    gives each campaign its own MLflow runs (the embedded store in its directory)."""
    m = base_manifest(shape, model, device, seed, tracking)
    if strategy in ("random", "tpe"):
        m["search"] = {
            "strategy": "optuna",
            "sampler": "random" if strategy == "random" else "tpe",
            "pruner": "none" if strategy == "random" else "median",
            "trial_generations": shape.trial_generations,
            "startup_trials": shape.population,
        }
    elif strategy == "fixed":
        m["population"] |= {"size": 1, "tournament_size": 1, "init_sampler": "none"}
        m["mutation"] |= {"no_mutation": 1.0, "rl_hp": 0.0}
        m["budget"] = {"generations": shape.population * shape.generations}
    elif strategy != "pbt":
        raise ValueError(f"strategy ({strategy!r}) must be one of {', '.join(STRATEGIES)}")
    return m


def member_steps(manifest: dict) -> int:
    """Training steps the campaign of ``manifest`` spends: slots x generations x evo_steps."""
    population = manifest["population"]
    return population["size"] * manifest["budget"]["generations"] * population["evo_steps"]


# -- running and reading campaigns ----------------------------------------------------------


MEMBER_COMMAND = [sys.executable, "-m", "pbt.worker"]
"""Members have one rank each: the worker runs without torchrun, so campaigns running side by
side never race for a rendezvous port."""


def run_campaigns(jobs: list[tuple[dict, Path]], parallel: int, env: dict[str, str]) -> None:
    """Run each (manifest, directory) as a campaign in a child process, ``parallel`` at a time;
    a directory that already holds a finished campaign of the same manifest is kept (the
    harness can be re-run).

    Raises:
        ValueError: a directory holds a finished campaign of another manifest.
        RuntimeError: a campaign failed; its log is named.
    """
    queue = [(m, d) for m, d in jobs if not _finished(m, d)]
    running: list[tuple[subprocess.Popen, Path, float]] = []
    while queue or running:
        while queue and len(running) < parallel:
            manifest, directory = queue.pop(0)
            shutil.rmtree(directory, ignore_errors=True)  # an unfinished earlier attempt
            directory.parent.mkdir(parents=True, exist_ok=True)
            path = directory.parent / f"{directory.name}.yaml"
            path.write_text(yaml.safe_dump(manifest, sort_keys=False))
            command = [sys.executable, __file__, "campaign", str(path), "--dir", str(directory)]
            with open(directory.parent / f"{directory.name}.log", "w") as log:
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((proc, directory, time.monotonic()))
            print(f"  started {directory.name}", flush=True)
        time.sleep(0.5)
        for item in [r for r in running if r[0].poll() is not None]:
            proc, directory, started = item
            running.remove(item)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"campaign {directory} failed (exit {proc.returncode}); see "
                    f"{directory.parent / (directory.name + '.log')}"
                )
            wall = time.monotonic() - started
            (directory / "finished.json").write_text(json.dumps({"wall_s": wall}))
            print(f"  finished {directory.name} in {wall:.0f} s", flush=True)


def _finished(manifest: dict, directory: Path) -> bool:
    from pbt.config.loader import manifest_from_dict

    if not (directory / "finished.json").exists():
        return False
    written = directory.parent / f"{directory.name}.yaml"
    # compared as validated manifests: a default spelt out is the same campaign
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


@dataclass(slots=True)
class Curve:
    """One campaign's best reward so far after each generation, against compute spent."""

    strategy: str
    seed: int
    steps: list[int]
    seconds: list[float]
    reward: list[float]
    budget_steps: int
    test_reward: float = math.nan
    """The final best member's reward on the test split (NaN: not scored)."""

    def to_target(self, target: float, unit: str = "steps") -> float:
        """Compute spent when the reward first reached ``target``; ``inf`` if never."""
        xs = self.steps if unit == "steps" else self.seconds
        return next((x for x, r in zip(xs, self.reward, strict=True) if r >= target), math.inf)


def read_curve(directory: Path, strategy: str, seed: int) -> Curve:
    """The campaign's reward-vs-compute curve, from its store and its members' results."""
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        members = [m for m in store.members() if m.status == "done" and m.fitness_history]
        config = store.load_config()
    evo_steps = config["manifest"]["population"]["evo_steps"]
    steps, seconds, reward = [], [], []
    spent_steps, spent_s, best = 0, 0.0, -math.inf
    for generation in sorted({m.generation for m in members}):
        for m in (m for m in members if m.generation == generation):
            result = directory / "tasks" / m.member_id / "result.json"
            if result.exists():  # else a clone that replaced a failed member: it trained nothing
                spent_steps += evo_steps
                spent_s += float(json.loads(result.read_text())["seconds"])
            best = max(best, m.fitness_history[-1])
        steps.append(spent_steps)
        seconds.append(spent_s)
        reward.append(best)
    return Curve(strategy, seed, steps, seconds, reward, member_steps(config["manifest"]))


def pbt_schedule(directory: Path) -> list[dict]:
    """The best final member's lineage, generation 0 first: its hyperparameters and reward."""
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        last = max(m.generation for m in store.members())
        done = [m for m in store.members(last) if m.fitness_history]
        m = max(done, key=lambda m: m.fitness_history[-1])
        chain = [m]
        while m.parent_id is not None:
            m = store.member(m.parent_id)
            chain.append(m)
    return [
        {"generation": m.generation, **m.hyperparameters, "reward": m.fitness_history[-1]}
        for m in reversed(chain)
    ]


# -- the test split -------------------------------------------------------------------------


def split_for_test(shape: Shape) -> list[tuple[str, str]]:
    """The last ``shape.test_size`` problems of the held-out reserve, as (question, answer):
    never trained on (the warm start and RL train outside the reserve) and disjoint from the
    eval split, the reserve's first ``shape.eval_size``.

    Raises:
        ValueError: the two splits would overlap.
    """
    from pbt.algorithms.builtin.addition import HELD_OUT, addition_split

    if shape.test_size <= 0 or shape.eval_size + shape.test_size > HELD_OUT:
        raise ValueError(
            f"test_size ({shape.test_size}) must be > 0 and eval_size ({shape.eval_size}) + "
            f"test_size must be <= {HELD_OUT}, the held-out reserve; lower test_size"
        )
    _, reserve = addition_split(HELD_OUT, 0)
    return reserve[HELD_OUT - shape.test_size :]


def best_member_reward(directory: Path, problems: list[tuple[str, str]]) -> dict:
    """The campaign's best member by eval reward (what the strategy would hand over), loaded
    from its checkpoint and scored on ``problems`` by the members' own evaluation (greedy at
    the manifest's ``eval_temperature``)."""
    import torch

    from pbt.algorithms.member import Member
    from pbt.algorithms.tasks import Example
    from pbt.config.loader import manifest_from_dict
    from pbt.controller.store import STORE_FILENAME, CampaignStore

    with CampaignStore(directory / STORE_FILENAME) as store:
        member_id, eval_reward = store.best()
        checkpoint = store.member(member_id).checkpoint
        config = store.load_config()
    manifest = manifest_from_dict(config["manifest"], base_dir=config["base_dir"])
    member = Member(manifest, torch.device(manifest.training.device))
    member.load(directory / checkpoint)
    reward = member.learner.evaluate(
        [Example(q, a) for q, a in problems],
        member.task.reward,
        manifest.training.eval_temperature,
    )
    return {"member": member_id, "eval_reward": eval_reward, "reward": reward}


def final_test_reward(directory: Path, problems: list[tuple[str, str]]) -> float:
    """:func:`best_member_reward` on the test split, kept in ``<campaign>/test.json``."""
    cached = directory / "test.json"
    if cached.exists():
        scored = json.loads(cached.read_text())
        if scored["problems"] == len(problems):
            return scored["reward"]
    scored = best_member_reward(directory, problems) | {"problems": len(problems)}
    cached.write_text(json.dumps(scored))
    return scored["reward"]


# -- the table ------------------------------------------------------------------------------


def summarize(curves: list[Curve], target: float) -> list[dict]:
    """One row per strategy: final reward over seeds, compute to the target, ratios to random.

    Compute to the target is the mean over seeds; a seed that never reached it counts as its
    whole budget, and the row says how many seeds reached it (the mean is then a lower bound).
    """
    rows = []
    for strategy in [s for s in STRATEGIES if any(c.strategy == s for c in curves)]:
        mine = [c for c in curves if c.strategy == strategy]
        finals = [c.reward[-1] for c in mine]
        tests = [c.test_reward for c in mine]
        reached = [c for c in mine if math.isfinite(c.to_target(target))]
        to_steps = [min(c.to_target(target), c.budget_steps) for c in mine]
        to_secs = [min(c.to_target(target, "seconds"), c.seconds[-1]) for c in mine]
        rows.append(
            {
                "strategy": strategy,
                "seeds": len(mine),
                **_spread("final", finals),
                **_spread("test", tests),
                "budget_steps": statistics.fmean(c.budget_steps for c in mine),
                "budget_s": statistics.fmean(c.seconds[-1] for c in mine),
                "reached": len(reached),
                "to_target_steps": statistics.fmean(to_steps),
                "to_target_s": statistics.fmean(to_secs),
            }
        )
    base = next((r for r in rows if r["strategy"] == "random"), None)
    for r in rows:
        r["steps_ratio"] = r["to_target_steps"] / base["to_target_steps"] if base else math.nan
        r["seconds_ratio"] = r["to_target_s"] / base["to_target_s"] if base else math.nan
        r["ratio_bound"] = _ratio_bound(r, base)
    return rows


def _spread(name: str, values: list[float]) -> dict[str, float]:
    """Mean, std, min and max of ``values`` as ``<name>_mean`` ...; all NaN where one value is
    NaN (a campaign not scored)."""
    if not all(map(math.isfinite, values)):
        return {f"{name}_{key}": math.nan for key in ("mean", "std", "min", "max")}
    return {
        f"{name}_mean": statistics.fmean(values),
        f"{name}_std": statistics.stdev(values) if len(values) > 1 else 0.0,
        f"{name}_min": min(values),
        f"{name}_max": max(values),
    }


def _ratio_bound(row: dict, base: dict | None) -> str:
    """How far a ratio to random search can be trusted when seeds never reached the target:
    ``""`` exact, ``"≤ "`` or ``"≥ "`` a bound, ``"?"`` unknown (both fell short)."""
    if base is None:
        return "?"
    mine, theirs = row["reached"] < row["seeds"], base["reached"] < base["seeds"]
    if mine and theirs:
        return "?" if row is not base else ""
    return "≥ " if mine else ("≤ " if theirs else "")


def format_table(rows: list[dict], target: float) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| strategy | final test-split reward, mean ± std (min–max) | final eval reward (it "
        f"selected), mean ± std | budget: member-steps (task-seconds) | seeds reaching "
        f"{target:g} | member-steps to {target:g} (ratio to random) | task-seconds to it "
        "(ratio) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = "" if r["reached"] == r["seeds"] else "≥ "
        test = (
            f"{r['test_mean']:.3f} ± {r['test_std']:.3f} ({r['test_min']:.3f}–{r['test_max']:.3f})"
            if math.isfinite(r["test_mean"])
            else "-"
        )
        lines.append(
            f"| {r['strategy']} | {test} | {r['final_mean']:.3f} ± {r['final_std']:.3f} | "
            f"{r['budget_steps']:.0f} "
            f"({r['budget_s']:.0f} s) | {r['reached']}/{r['seeds']} | "
            f"{bound}{r['to_target_steps']:.0f} ({_ratio(r, 'steps_ratio')}) | "
            f"{bound}{r['to_target_s']:.0f} s ({_ratio(r, 'seconds_ratio')}) |"
        )
    return "\n".join(lines)


def _ratio(row: dict, key: str) -> str:
    bound = row["ratio_bound"]
    return "ratio unknown" if bound == "?" else f"{bound}{row[key]:.2f}"


def format_sweep(curves: list[Curve], targets: list[float]) -> str:
    """Mean member-steps to reach each of ``targets`` per strategy (ratio to random search), as
    a Markdown table; ``≥`` marks a mean in which some seed never got there (counted at its
    budget), ``-`` a target no seed reached."""
    strategies = [s for s in STRATEGIES if any(c.strategy == s for c in curves)]
    lines = [
        "| reward target | " + " | ".join(strategies) + " |",
        "|---|" + "---|" * len(strategies),
    ]
    for target in targets:
        rows = {r["strategy"]: r for r in summarize(curves, target)}
        cells = []
        for s in strategies:
            r = rows[s]
            if r["reached"] == 0:
                cells.append(f"- (0/{r['seeds']})")
                continue
            bound = "" if r["reached"] == r["seeds"] else "≥ "
            cells.append(
                f"{bound}{r['to_target_steps']:.0f} ({_ratio(r, 'steps_ratio')}, "
                f"{r['reached']}/{r['seeds']})"
            )
        lines.append(f"| {target:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- plots and MLflow -----------------------------------------------------------------------


def plot_reward_vs_compute(curves: list[Curve], target: float, path: Path) -> Path:
    """Best held-out reward so far against member-steps: each seed thin, the mean thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    colors = dict(zip(STRATEGIES, ("C3", "C0", "C2", "C7"), strict=True))
    for strategy in STRATEGIES:
        mine = [c for c in curves if c.strategy == strategy]
        if not mine:
            continue
        for c in mine:
            ax.step(c.steps, c.reward, where="post", color=colors[strategy], alpha=0.25, lw=0.8)
        grid = sorted({x for c in mine for x in c.steps})
        mean = [statistics.fmean(_at(c, x) for c in mine) for x in grid]
        style = "--" if strategy == "random" else "-"  # random and tpe often overlap
        ax.step(
            grid, mean, style, where="post", color=colors[strategy], lw=2, label=strategy, zorder=3
        )
    ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:g}")
    ax.set_xlabel("compute: member training steps")
    ax.set_ylabel("best held-out reward so far")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _at(curve: Curve, x: int) -> float:
    """The curve's reward at compute ``x`` (its last value at or before ``x``)."""
    values = [r for s, r in zip(curve.steps, curve.reward, strict=True) if s <= x]
    return values[-1] if values else curve.reward[0]


def plot_schedules(schedules: dict[int, list[dict]], path: Path) -> Path:
    """PBT's lr, temperature and reward along each seed's best lineage, per generation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("lr", "temperature", "reward")
    fig, axes = plt.subplots(1, 3, figsize=(9.6, 3.0), dpi=90)
    for seed, chain in sorted(schedules.items()):
        gens = [g["generation"] for g in chain]
        for ax, key in zip(axes, keys, strict=True):
            ax.plot(gens, [g[key] for g in chain], marker="o", ms=3, label=f"seed {seed}")
    for ax, key in zip(axes, keys, strict=True):
        ax.set_title(key)
        ax.set_xlabel("generation")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def log_to_mlflow(uri: str, params: dict, rows: list[dict], files: list[Path]) -> str:
    """One run in the ``pbt-vs-search`` experiment: the settings, each strategy's figures as
    metrics, the table and the plots as artifacts. Returns the run id."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("pbt-vs-search")
    # artifacts beside the database, not in ./mlruns of whatever folder the command ran in
    where = (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    exp_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment("pbt-vs-search", artifact_location=where)
    )
    run = client.create_run(exp_id, run_name=time.strftime("compare-%Y%m%d-%H%M%S"))
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    for r in rows:
        for key in (
            "test_mean",
            "test_std",
            "final_mean",
            "final_std",
            "to_target_steps",
            "steps_ratio",
            "budget_s",
        ):
            if math.isfinite(r[key]):
                client.log_metric(run.info.run_id, f"{r['strategy']}.{key}", r[key])
    for path in files:
        client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


# -- the commands ---------------------------------------------------------------------------


def warm_model(shape: Shape, device: str) -> str:
    """The warm-started model's folder for ``shape`` (built once, cached)."""
    from pbt.algorithms.builtin.addition import WarmStart, warm_model_dir

    recipe = WarmStart(model=shape.warm_model, steps=shape.warm_steps)
    start = time.perf_counter()
    folder = warm_model_dir(recipe, seed=0)
    print(f"warm-started model: {folder} ({time.perf_counter() - start:.0f} s)", flush=True)
    return str(folder)


def resolve_shape(args: argparse.Namespace) -> Shape:
    """The shape of ``--shape`` with ``--population`` and ``--resample-probability`` applied."""
    shape = SHAPES[args.shape]
    if args.population is not None:
        if args.population < 2:
            raise ValueError(f"--population ({args.population}) must be >= 2; raise it")
        shape = replace(shape, population=args.population)
    if args.resample_probability is not None:
        if not 0 <= args.resample_probability <= 1:
            raise ValueError(
                f"--resample-probability ({args.resample_probability}) must be in [0, 1]"
            )
        shape = replace(shape, resample_probability=args.resample_probability)
    return shape


def results_stem(args: argparse.Namespace) -> str:
    """The name of the result files: the shape's, plus the population when it is overridden
    (so a run at another population does not overwrite the default one's)."""
    return args.shape if args.population is None else f"{args.shape}_p{args.population}"


def compare(args: argparse.Namespace) -> list[dict]:
    """Run every strategy for every seed, score each final best member on the test split, then
    print the table, plot and log to MLflow."""
    shape = resolve_shape(args)
    problems = split_for_test(shape)
    target = args.target if args.target is not None else shape.target
    model = warm_model(shape, args.device)
    work = Path(args.work_dir).resolve()
    jobs = [
        (
            strategy_manifest(s, shape, model, args.device, seed, args.campaign_tracking),
            work / f"{s}-s{seed}",
        )
        for seed in range(args.seeds)
        for s in args.strategies
    ]
    budgets = {member_steps(m) for m, _ in jobs}
    print(f"{len(jobs)} campaigns, {budgets.pop()} member-steps each", flush=True)
    env = dict(os.environ)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # one core per member; --parallel campaigns at once
    run_campaigns(jobs, args.parallel, env)
    curves = []
    for seed in range(args.seeds):
        for s in args.strategies:
            curve = read_curve(work / f"{s}-s{seed}", s, seed)
            curve.test_reward = final_test_reward(work / f"{s}-s{seed}", problems)
            curves.append(curve)
    rows = summarize(curves, target)
    table = format_table(rows, target)
    sweep = format_sweep(curves, args.sweep)
    table += "\n\nMember-steps to reach each reward (ratio to random, seeds reaching it):\n\n"
    table += sweep
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = results_stem(args)
    files = [plot_reward_vs_compute(curves, target, out / f"pbt_vs_search_{stem}.png")]
    if "pbt" in args.strategies:
        schedules = {seed: pbt_schedule(work / f"pbt-s{seed}") for seed in range(args.seeds)}
        files.append(plot_schedules(schedules, out / f"pbt_schedules_{stem}.png"))
    data = out / f"pbt_vs_search_{stem}.json"
    data.write_text(json.dumps({"rows": rows, "curves": [asdict(c) for c in curves]}))
    (out / f"pbt_vs_search_{stem}.md").write_text(table + "\n")
    params = {
        "shape": args.shape,
        "device": args.device,
        "seeds": args.seeds,
        "target": target,
        "population": shape.population,
        "resample_probability": shape.resample_probability,
        "member_steps": member_steps(jobs[0][0]),
        "test_size": shape.test_size,
    }
    run_id = log_to_mlflow(f"sqlite:///{work / 'mlflow.db'}", params, rows, [*files, data])
    print(f"plots: {', '.join(map(str, files))}; MLflow run {run_id} in {work / 'mlflow.db'}")
    return rows


def calibrate(args: argparse.Namespace) -> None:
    """The warm-started model's held-out reward, then that of one member after RL at each lr."""
    shape = resolve_shape(args)
    model = warm_model(shape, args.device)
    work = Path(args.work_dir).resolve() / "calibrate"
    steps = shape.generations * shape.evo_steps
    jobs = []
    for lr in args.lrs:
        m = strategy_manifest("fixed", shape, model, args.device, seed=0)
        m["optim"]["lr"] = lr
        m["population"]["evo_steps"] = steps // 2
        m["budget"] = {"generations": 2}
        jobs.append((m, work / f"lr{lr:g}"))
    env = dict(os.environ)
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    run_campaigns(jobs, args.parallel, env)
    from pbt.algorithms.builtin.addition import addition_split

    _, eval_split = addition_split(shape.eval_size, 0)
    for name, problems in (("eval", eval_split), ("test", split_for_test(shape))):
        before = held_out_reward(model, problems, args.device)
        print(f"warm start, {name}-split reward (greedy, {len(problems)} problems): {before:.3f}")
    for lr, (_, directory) in zip(args.lrs, jobs, strict=True):
        curve = read_curve(directory, "fixed", 0)
        print(f"lr {lr:g}: after {curve.steps} steps: {[f'{r:.3f}' for r in curve.reward]}")


def held_out_reward(model: str, held_out: list[tuple[str, str]], device: str) -> float:
    """Greedy exact-answer reward of ``model`` (no adapter) on the ``held_out`` problems."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pbt.algorithms.rollout.hf import chat_prompts
    from pbt.algorithms.tasks import arithmetic_reward

    tokenizer = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model).to(device).eval()
    enc = tokenizer(
        chat_prompts(tokenizer, [q for q, _ in held_out]),
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
        arithmetic_reward(t, a, q) for t, (q, a) in zip(texts, held_out, strict=True)
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of the three subcommands."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["compare", "calibrate", "campaign"])
    parser.add_argument("manifest", nargs="?", help="campaign: the manifest to run")
    parser.add_argument("--dir", help="campaign: its directory")
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--population", type=int, help="default: the shape's")
    parser.add_argument(
        "--resample-probability",
        type=float,
        help="PBT: chance a mutation redraws the value from its range (default: the shape's, 0)",
    )
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--target", type=float, default=None, help="default: the shape's")
    parser.add_argument(
        "--sweep",
        type=float,
        nargs="+",
        default=[0.55, 0.6, 0.65, 0.7, 0.75],
        help="more reward targets, for the compute-to-target sweep",
    )
    parser.add_argument("--parallel", type=int, default=2, help="campaigns at once")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    parser.add_argument("--work-dir", default="runs/pbt_vs_search")
    parser.add_argument(
        "--campaign-tracking", action="store_true", help="MLflow runs for every campaign too"
    )
    parser.add_argument("--out", default="bench/results")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        compare(args)
    elif args.command == "calibrate":
        calibrate(args)
    else:
        run_one(Path(args.manifest), Path(args.dir))


if __name__ == "__main__":
    main()
