"""The figures of ``bench/proof_of_value.py``: reward-vs-compute curves, their statistics over
seeds (bootstrap confidence intervals, paired differences, compute to a target), the tables, the
plots, merging result files of several calls, and the sweep's envelope (how soon any one fixed
configuration reaches a target). Plain Python, numpy and scipy; matplotlib for the plots."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

STRATEGIES = ("pbt", "pbt_ready", "pbt_gap", "pb2", "random", "tpe", "default")
PBT_VARIANTS = ("pbt", "pbt_ready", "pbt_gap", "pb2")


@dataclass(slots=True)
class Curve:
    """One strategy's best eval reward so far after each generation, against member-steps."""

    task: str
    strategy: str
    seed: int
    steps: list[int]
    reward: list[float]
    test_reward: float = math.nan
    """The best member's (by eval reward) reward on the test split."""
    test_mean: float = math.nan
    """``default``: the mean test reward of its runs' best members."""
    wall_s: float = math.nan
    """Wall seconds of the strategy's campaigns (run one at a time, summed)."""

    def to_target(self, target: float) -> float:
        """Member-steps spent when the reward first reached ``target``; ``inf`` if never."""
        return next(
            (x for x, r in zip(self.steps, self.reward, strict=True) if r >= target), math.inf
        )


# -- statistics -----------------------------------------------------------------------------


def bootstrap_ci(values: list[float], level: float = 0.95, resamples: int = 10_000) -> tuple:
    """Mean of ``values`` and the percentile bootstrap confidence interval of that mean
    (``scipy.stats.bootstrap``, seeded); an interval of one value is the value."""
    import numpy as np
    from scipy.stats import bootstrap

    data = np.asarray(values, dtype=float)
    mean = float(data.mean())
    if len(data) < 2 or np.all(data == data[0]):
        return mean, mean, mean
    ci = bootstrap(
        (data,),
        np.mean,
        confidence_level=level,
        n_resamples=resamples,
        method="percentile",
        random_state=np.random.default_rng(0),
    ).confidence_interval
    return mean, float(ci.low), float(ci.high)


def paired_t_interval(differences: list[float], level: float = 0.95) -> tuple:
    """Mean of paired ``differences`` and its Student-t confidence interval (n - 1 degrees of
    freedom); one difference, or all equal, is its own interval."""
    from scipy.stats import t as student

    n = len(differences)
    mean = statistics.fmean(differences)
    if n < 2 or len(set(differences)) == 1:
        return mean, mean, mean
    half = student.ppf(0.5 + level / 2, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return mean, mean - half, mean + half


def wilcoxon_p(differences: list[float]) -> float:
    """Two-sided p of the Wilcoxon signed-rank test of paired ``differences`` (zeros dropped):
    ``scipy.stats.wilcoxon`` (exact for small samples) where scipy is installed, else the exact
    null distribution by enumerating every sign pattern of the ranks (mid-ranks for ties)."""
    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        return 1.0
    try:
        from scipy.stats import wilcoxon
    except ImportError:
        return _exact_wilcoxon(nonzero)
    return float(wilcoxon(nonzero, zero_method="wilcox", alternative="two-sided").pvalue)


def _exact_wilcoxon(nonzero: list[float]) -> float:
    import itertools

    order = sorted(range(len(nonzero)), key=lambda i: abs(nonzero[i]))
    ranks = [0.0] * len(nonzero)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(nonzero[order[j + 1]]) == abs(nonzero[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    observed = sum(r for r, d in zip(ranks, nonzero, strict=True) if d > 0)
    centre = sum(ranks) / 2
    patterns = list(itertools.product((0, 1), repeat=len(ranks)))
    extreme = sum(
        abs(sum(r for r, s in zip(ranks, signs, strict=True) if s) - centre)
        >= abs(observed - centre) - 1e-12
        for signs in patterns
    )
    return extreme / len(patterns)


def wins_ties_losses(differences: list[float], tie: float = 0.0) -> tuple[int, int, int]:
    """How many paired differences are above ``tie``, within it, and below ``-tie``."""
    wins = sum(d > tie for d in differences)
    losses = sum(d < -tie for d in differences)
    return wins, len(differences) - wins - losses, losses


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p values of a family of tests (step-down, monotone, capped at 1)."""
    ordered = sorted(p_values, key=lambda k: p_values[k])
    adjusted, running = {}, 0.0
    for i, key in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - i) * p_values[key]))
        adjusted[key] = running
    return adjusted


def paired_comparison(ours: dict[int, float], theirs: dict[int, float]) -> dict:
    """The pre-registered figures of one comparison over the seeds both have: mean difference,
    paired t 95% interval, Wilcoxon p, wins / ties / losses."""
    seeds = sorted(set(ours) & set(theirs))
    diffs = [ours[s] - theirs[s] for s in seeds]
    if not diffs:
        return {"seeds": [], "n": 0}
    mean, low, high = paired_t_interval(diffs)
    return {
        "seeds": seeds,
        "n": len(diffs),
        "differences": diffs,
        "mean": mean,
        "t95": [low, high],
        "wilcoxon_p": wilcoxon_p(diffs),
        "wins_ties_losses": list(wins_ties_losses(diffs)),
    }


def summarize(curves: list[Curve], task: str, target: float) -> dict:
    """The task's figures: per strategy the test reward's mean and CI over seeds, compute to
    the target, wall; per other strategy the paired difference PBT minus it with its CI."""
    mine = [c for c in curves if c.task == task]
    strategies = [s for s in STRATEGIES if any(c.strategy == s for c in mine)]
    rows = {}
    for s in strategies:
        cs = sorted((c for c in mine if c.strategy == s), key=lambda c: c.seed)
        to = [c.to_target(target) for c in cs]
        rows[s] = {
            "seeds": [c.seed for c in cs],
            "test": [c.test_reward for c in cs],
            "test_ci": bootstrap_ci([c.test_reward for c in cs]),
            "test_mean_runs": bootstrap_ci([c.test_mean for c in cs]),
            "eval_ci": bootstrap_ci([c.reward[-1] for c in cs]),
            "reached": sum(math.isfinite(t) for t in to),
            "to_target": to,
            "to_target_mean": statistics.fmean(
                min(t, c.steps[-1]) for t, c in zip(to, cs, strict=True)
            ),
            "budget": statistics.fmean(c.steps[-1] for c in cs),
            "wall_s": statistics.fmean(c.wall_s for c in cs),
        }
    diffs: dict[str, dict] = {}
    for p in (p for p in PBT_VARIANTS if p in rows):
        for s in strategies:
            if s in PBT_VARIANTS or rows[s]["seeds"] != rows[p]["seeds"]:
                continue
            d = [a - b for a, b in zip(rows[p]["test"], rows[s]["test"], strict=True)]
            wins = sum(x > 0 for x in d)
            diffs.setdefault(p, {})[s] = {"diff": d, "ci": bootstrap_ci(d), "wins": wins}
    return {"task": task, "target": target, "rows": rows, "diffs": diffs}


def format_summary(summary: dict) -> str:
    """The task's tables, in Markdown."""
    target, rows = summary["target"], summary["rows"]
    base = rows.get("random")
    lines = [
        f"| strategy | test reward, mean [95% CI] | eval reward (selected on), mean | member-steps "
        f"| seeds reaching {target:g} (eval) | member-steps to {target:g}, mean (ratio to "
        "random) | wall per campaign set, mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for s, r in rows.items():
        m, lo, hi = r["test_ci"]
        bound = "" if r["reached"] == len(r["seeds"]) else "≥ "
        ratio = r["to_target_mean"] / base["to_target_mean"] if base else math.nan
        exact = r["reached"] == len(r["seeds"]) and base and base["reached"] == len(base["seeds"])
        ratio_text = f"{ratio:.2f}" if exact else f"{ratio:.2f}, bound"
        extra = ""
        if s == "default":
            dm, dlo, dhi = r["test_mean_runs"]
            extra = f" (the best run by eval; all runs' mean {dm:.3f} [{dlo:.3f}, {dhi:.3f}])"
        lines.append(
            f"| {s} | {m:.3f} [{lo:.3f}, {hi:.3f}]{extra} | {r['eval_ci'][0]:.3f} | "
            f"{r['budget']:.0f} | {r['reached']}/{len(r['seeds'])} | "
            f"{bound}{r['to_target_mean']:.0f} ({ratio_text}) | {r['wall_s']:.0f} s |"
        )
    if summary.get("tpe_trials"):
        t = summary["tpe_trials"]
        lines += [
            "",
            f"TPE, per seed: trials {[x['trials'] for x in t]}, pruned {[x['pruned'] for x in t]}, "
            f"drawn from its model {[x['guided'] for x in t]} (the first at generation "
            f"{[x['first_guided_generation'] for x in t]})",
        ]
    if summary["diffs"]:
        lines += [
            "",
            "| difference | paired difference of test reward, mean [95% CI] | seeds ahead |",
            "|---|---|---|",
        ]
        for p, against in summary["diffs"].items():
            for s, d in against.items():
                m, lo, hi = d["ci"]
                lines.append(
                    f"| {p} - {s} | {m:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                    f"{d['wins']}/{len(d['diff'])} |"
                )
    return "\n".join(lines)


# -- plots ----------------------------------------------------------------------------------


def plot_curves(curves: list[Curve], task: str, target: float, path: Path) -> Path:
    """Best eval reward so far against member-steps: each seed thin, the mean thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    colors = dict(zip(STRATEGIES, ("C3", "C1", "C4", "C5", "C0", "C2", "C7"), strict=True))
    for strategy in STRATEGIES:
        mine = [c for c in curves if c.strategy == strategy and c.task == task]
        if not mine:
            continue
        for c in mine:
            ax.step(c.steps, c.reward, where="post", color=colors[strategy], alpha=0.2, lw=0.8)
        grid = sorted({x for c in mine for x in c.steps})
        mean = [statistics.fmean(_at(c, x) for c in mine) for x in grid]
        style = "--" if strategy == "random" else "-"
        ax.step(grid, mean, style, where="post", color=colors[strategy], lw=2, label=strategy)
    ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:g}")
    ax.set_title(task)
    ax.set_xlabel("compute: member training steps")
    ax.set_ylabel("best eval reward so far")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _at(curve: Curve, x: int) -> float:
    values = [r for s, r in zip(curve.steps, curve.reward, strict=True) if s <= x]
    return values[-1] if values else curve.reward[0]


def plot_sweep(
    grid: dict[tuple[float, float], list[float]], steps: list[int], task: str, path: Path
) -> Path:
    """The sweep's eval reward after each generation, one line per (lr, temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({t for _, t in grid})
    fig, axes = plt.subplots(1, len(temps), figsize=(3.2 * len(temps), 3.2), dpi=90, sharey=True)
    for ax, temp in zip(axes, temps, strict=True):
        for (lr, t), rewards in sorted(grid.items()):
            if t == temp:
                ax.plot(steps[: len(rewards)], rewards, marker="o", ms=2, label=f"lr {lr:g}")
        ax.set_title(f"{task}, temperature {temp:g}")
        ax.set_xlabel("steps")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval reward")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- several calls' results as one ----------------------------------------------------------


def merge(paths: list[Path], targets: dict[str, float]) -> dict:
    """One result of several ``compare`` result files of the same shape (e.g. seeds run in
    several calls): their curves together, the figures recomputed over all seeds, each task's
    target from ``targets`` or else the first file's.

    Raises:
        ValueError: the files' shapes differ, or two hold the same task, strategy and seed.
    """
    data = [json.loads(Path(p).read_text()) for p in paths]
    shape = data[0]["shape"]
    for p, d in zip(paths[1:], data[1:], strict=True):
        if d["shape"] != shape:
            raise ValueError(f"{p} was run at another shape than {paths[0]}; merge only one shape")
    curves, seen, trials = [], {}, {}
    for p, d in zip(paths, data, strict=True):
        for c in map(lambda c: Curve(**c), d["curves"]):
            key = (c.task, c.strategy, c.seed)
            if key in seen:
                raise ValueError(f"{p} and {seen[key]} both hold {key}; merge disjoint seeds")
            seen[key] = p
            curves.append(c)
        for s in d["summaries"]:
            tpe_seeds = sorted(
                c.seed for c in curves if c.task == s["task"] and c.strategy == "tpe"
            )
            mine = [x for x in tpe_seeds if seen[(s["task"], "tpe", x)] == p]
            if s.get("tpe_trials"):
                trials.update(
                    {(s["task"], x): t for x, t in zip(mine, s["tpe_trials"], strict=True)}
                )
            targets = {s["task"]: s["target"]} | targets
    summaries = []
    for task in dict.fromkeys(c.task for c in curves):
        summary = summarize(curves, task, float(targets.get(task, math.nan)))
        summary["tpe_trials"] = [t for (k, _), t in sorted(trials.items()) if k == task]
        summaries.append(summary)
    return {"shape": shape, "curves": [asdict(c) for c in curves], "summaries": summaries}


# -- the sweep's envelope -------------------------------------------------------------------


def envelope(sweep: Path, target: float, slots: int) -> dict:
    """How soon any one fixed configuration of a sensitivity sweep (``sweep`` writes one line
    per configuration: its eval reward after each generation) reaches ``target``: the best
    reward of any configuration at each depth, the first depth where it reaches the target,
    and the member-steps a population of ``slots`` running that configuration in every slot
    spends to get there (its lineages are that deep then)."""
    lines = Path(sweep).read_text().splitlines()
    depths = [
        int(x) for x in lines[0].split("eval reward after ")[1].split(" steps")[0].split(", ")
    ]
    runs = {
        line.split(":")[0]: [float(x) for x in line.split(":")[1].split()]
        for line in lines[1:]
        if line.startswith("lr ")
    }
    best = [max(r[i] for r in runs.values() if i < len(r)) for i in range(len(depths))]
    first = next((i for i, r in enumerate(best) if r >= target), None)
    if first is None:
        return {"depths": depths, "best": best, "depth": None, "config": None, "member_steps": None}
    config = next(name for name, r in runs.items() if len(r) > first and r[first] == best[first])
    return {
        "depths": depths,
        "best": best,
        "depth": depths[first],
        "config": config,
        "member_steps": slots * depths[first],
    }
