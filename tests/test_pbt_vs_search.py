"""The comparison harness's accounting: every strategy gets the same compute, and the table
has one row per strategy with ratios against random search. Not the scientific result."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pbt_vs_search as harness

from pbt.manifest import manifest_from_dict

MICRO = harness.Shape(
    warm_steps=2,
    population=2,
    generations=2,
    evo_steps=1,
    trial_generations=1,
    eval_size=8,
    group_size=2,
    prompts_per_step=2,
    target=0.5,
)


@pytest.mark.parametrize("shape", [*harness.SHAPES.values(), MICRO])
def test_every_strategy_gets_the_same_member_steps(shape: harness.Shape) -> None:
    budgets = {}
    for strategy in harness.STRATEGIES:
        raw = harness.strategy_manifest(strategy, shape, "builtin:tiny", "cpu", seed=0)
        manifest = manifest_from_dict(raw, base_dir=".")  # the real validation
        assert manifest.task.name == "builtin:addition"
        budgets[strategy] = harness.member_steps(raw)
    assert set(budgets.values()) == {shape.population * shape.generations * shape.evo_steps}


def test_target_is_censored_at_the_budget() -> None:
    reached = harness.Curve("random", 0, [10, 20, 30], [1.0, 2.0, 3.0], [0.1, 0.6, 0.9], 30)
    never = harness.Curve("random", 1, [10, 20, 30], [1.0, 2.0, 3.0], [0.1, 0.2, 0.3], 30)
    fast = harness.Curve("pbt", 0, [10, 20, 30], [1.0, 2.0, 3.0], [0.7, 0.8, 0.9], 30)
    assert reached.to_target(0.5) == 20 and math.isinf(never.to_target(0.5))
    rows = {r["strategy"]: r for r in harness.summarize([reached, never, fast], 0.5)}
    assert rows["random"]["reached"] == 1 and rows["random"]["to_target_steps"] == 25.0
    assert rows["pbt"]["steps_ratio"] == pytest.approx(10 / 25)
    assert rows["random"]["final_mean"] == pytest.approx(0.6)


def test_real_campaigns_spend_equal_budgets_and_fill_the_table(tmp_path: Path) -> None:
    model = harness.warm_model(MICRO, "cpu")
    strategies = ("pbt", "random")
    jobs = [
        (harness.strategy_manifest(s, MICRO, model, "cpu", seed=0), tmp_path / f"{s}-s0")
        for s in strategies
    ]
    harness.run_campaigns(jobs, parallel=2, env=dict(os.environ, OMP_NUM_THREADS="1"))
    curves = [harness.read_curve(d, s, 0) for s, (_, d) in zip(strategies, jobs, strict=True)]
    for curve in curves:
        assert curve.steps == [2, 4] and curve.budget_steps == 4
        assert all(s > 0 for s in curve.seconds) and curve.reward == sorted(curve.reward)
    rows = harness.summarize(curves, MICRO.target)
    assert [r["strategy"] for r in rows] == list(strategies)
    assert rows[1]["steps_ratio"] == 1.0
    table = harness.format_table(rows, MICRO.target).splitlines()
    assert len(table) == 2 + len(strategies)
    assert all(line.count("|") == table[0].count("|") for line in table)
    schedule = harness.pbt_schedule(tmp_path / "pbt-s0")
    assert [g["generation"] for g in schedule] == [0, 1]
    assert {"lr", "temperature", "reward"} <= set(schedule[0])
