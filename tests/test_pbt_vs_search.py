"""The comparison harness's accounting: every strategy gets the same compute, and the table
has one row per strategy with ratios against random search. Not the scientific result."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pbt_vs_search as harness

from pbt.algorithms.builtin.addition import addition_split
from pbt.config.loader import manifest_from_dict
from pbt.controller.store import STORE_FILENAME, CampaignStore

MICRO = harness.Shape(
    warm_steps=2,
    population=2,
    generations=2,
    evo_steps=1,
    trial_generations=1,
    eval_size=8,
    test_size=8,
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


def test_population_and_resample_options_reach_every_manifest() -> None:
    args = harness.build_parser().parse_args(
        ["compare", "--population", "8", "--resample-probability", "0.25"]
    )
    shape = harness.resolve_shape(args)
    assert harness.results_stem(args) == "tiny_p8"
    raw = {s: harness.strategy_manifest(s, shape, "builtin:tiny", "cpu", 0) for s in ("pbt", "tpe")}
    manifest = manifest_from_dict(raw["pbt"], base_dir=".")
    assert manifest.population.size == 8 and manifest.mutation.resample_probability == 0.25
    assert manifest_from_dict(raw["tpe"], base_dir=".").search.startup_trials == 8
    budgets = {
        harness.member_steps(harness.strategy_manifest(s, shape, "builtin:tiny", "cpu", 0))
        for s in harness.STRATEGIES
    }
    assert budgets == {8 * shape.generations * shape.evo_steps}
    default = harness.resolve_shape(harness.build_parser().parse_args(["compare"]))
    assert default == harness.SHAPES["tiny"] and default.resample_probability == 0.0
    for bad in (["--population", "1"], ["--resample-probability", "1.5"]):
        with pytest.raises(ValueError, match=bad[0]):
            harness.resolve_shape(harness.build_parser().parse_args(["compare", *bad]))


@pytest.mark.parametrize("shape", [*harness.SHAPES.values(), MICRO])
def test_test_split_is_disjoint_from_eval_and_training(shape: harness.Shape) -> None:
    test = harness.split_for_test(shape)
    train, evaluation = addition_split(shape.eval_size, 10**9)
    assert len(test) == len(set(test)) == shape.test_size
    assert not set(test) & set(evaluation) and not set(test) & set(train)
    with pytest.raises(ValueError, match="test_size"):
        harness.split_for_test(harness.Shape(eval_size=800, test_size=256))


def test_target_is_censored_at_the_budget() -> None:
    reached = harness.Curve("random", 0, [10, 20, 30], [1.0, 2.0, 3.0], [0.1, 0.6, 0.9], 30)
    never = harness.Curve("random", 1, [10, 20, 30], [1.0, 2.0, 3.0], [0.1, 0.2, 0.3], 30)
    fast = harness.Curve("pbt", 0, [10, 20, 30], [1.0, 2.0, 3.0], [0.7, 0.8, 0.9], 30)
    assert reached.to_target(0.5) == 20 and math.isinf(never.to_target(0.5))
    rows = {r["strategy"]: r for r in harness.summarize([reached, never, fast], 0.5)}
    assert rows["random"]["reached"] == 1 and rows["random"]["to_target_steps"] == 25.0
    assert rows["pbt"]["steps_ratio"] == pytest.approx(10 / 25)
    assert rows["random"]["final_mean"] == pytest.approx(0.6)


@pytest.mark.integration
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

    # the final member re-scored on the eval split by the same code gives its recorded fitness
    _, evaluation = addition_split(MICRO.eval_size, 0)
    rescored = harness.best_member_reward(tmp_path / "pbt-s0", evaluation)
    with CampaignStore(tmp_path / "pbt-s0" / STORE_FILENAME) as store:
        assert (rescored["member"], rescored["eval_reward"]) == store.best()
    assert rescored["reward"] == pytest.approx(rescored["eval_reward"])
    test = harness.final_test_reward(tmp_path / "pbt-s0", harness.split_for_test(MICRO))
    assert 0.0 <= test <= 1.0 and (tmp_path / "pbt-s0" / "test.json").exists()

    # a finished campaign is kept on a re-run, but never silently taken for another manifest
    finished = (tmp_path / "pbt-s0" / "finished.json").read_text()
    harness.run_campaigns(jobs, parallel=1, env={})
    assert (tmp_path / "pbt-s0" / "finished.json").read_text() == finished
    other = harness.strategy_manifest(
        "pbt", replace(MICRO, resample_probability=0.5), model, "cpu", 0
    )
    with pytest.raises(ValueError, match="another manifest"):
        harness.run_campaigns([(other, tmp_path / "pbt-s0")], parallel=1, env={})
