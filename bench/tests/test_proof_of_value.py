"""The proof-of-value harness's accounting: every strategy trains exactly N x T member-steps,
at most N at a time, read back from real campaign stores, and the test split never reaches a
campaign. Not the scientific result (bench/RESULTS.md has that)."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/

import proof_of_value as harness
import proof_stats as stats
import proof_tasks

from pbt.algorithms.runtime.member import load_data
from pbt.config.read.loader import manifest_from_dict
from pbt.controller.store import STORE_FILENAME, CampaignStore

MICRO = replace(harness.SHAPES["micro"], warm_steps={"addition": 2, "chain_sum": 2})


@pytest.mark.parametrize("shape", list(harness.SHAPES))
@pytest.mark.parametrize("task", harness.TASKS)
def test_every_strategy_plans_n_times_t_member_steps(shape: str, task: str, tmp_path: Path) -> None:
    s = harness.SHAPES[shape]
    data = harness.write_task_files(task, s, tmp_path)
    for strategy in harness.STRATEGIES:
        raws = harness.strategy_manifests(strategy, task, s, "builtin:tiny", data, "cpu", 3)
        manifests = [manifest_from_dict(raw, base_dir=".") for raw in raws]  # real validation
        planned = sum(
            m.population.size * m.budget.generations * m.population.evo_steps for m in manifests
        )
        assert planned == s.slots * s.steps
        assert max(m.population.size for m in manifests) <= s.slots
        assert all(m.algorithm.collapse_patience is None for m in manifests)
    ready = manifest_from_dict(
        harness.strategy_manifests("pbt_ready", task, s, "builtin:tiny", data, "cpu", 0)[0], "."
    )
    assert ready.population.selection == "truncation"
    assert ready.population.ready_generations == harness.READY_GENERATIONS
    gap = manifest_from_dict(
        harness.strategy_manifests("pbt_gap", task, s, "builtin:tiny", data, "cpu", 0)[0], "."
    )
    assert gap.population.ready_generations == harness.READY_GENERATIONS
    assert gap.population.exploit_gap == harness.EXPLOIT_GAP and ready.population.exploit_gap == 0
    pb2 = manifest_from_dict(
        harness.strategy_manifests("pb2", task, s, "builtin:tiny", data, "cpu", 0)[0], "."
    )
    assert (pb2.search.strategy, pb2.population.selection) == ("pb2", "truncation")
    assert pb2.population.ready_generations == harness.READY_GENERATIONS
    tpe = manifest_from_dict(
        harness.strategy_manifests("tpe", task, s, "builtin:tiny", data, "cpu", 0)[0], "."
    )
    assert tpe.search.pruner == "successive_halving"
    assert tpe.search.trial_generations == s.generations
    default = harness.strategy_manifests("default", task, s, "builtin:tiny", data, "cpu", 3)
    assert len({m["training"]["seed"] for m in default}) == s.slots
    assert all("optim" not in m for m in default)  # the library's own lr


@pytest.mark.parametrize("task", harness.TASKS)
def test_splits_are_disjoint_and_the_test_rows_are_not_written(task: str, tmp_path: Path) -> None:
    shape = harness.SHAPES["cpu"]
    splits = harness.task_splits(task, shape)
    questions = {name: {q for q, _ in rows} for name, rows in splits.items()}
    assert len(splits["test"]) == shape.test_size and len(splits["eval"]) == shape.eval_size
    assert not questions["test"] & questions["eval"]
    assert not questions["test"] & questions["train"]
    assert not questions["eval"] & questions["train"]
    data = harness.write_task_files(task, shape, tmp_path)
    written = "".join(p.read_text() for p in tmp_path.iterdir())
    assert not any(f'"{q}"' in written for q in questions["test"])
    # what a campaign of this task loads to train and select on holds no test row
    raw = harness.strategy_manifests("pbt", task, shape, "builtin:tiny", data, "cpu", 0)[0]
    loaded = load_data(manifest_from_dict(raw, base_dir="."))
    seen = {e.question for e in loaded.eval} | {e.question for e in loaded.train}
    assert not seen & questions["test"]
    assert {e.question for e in loaded.eval} == questions["eval"]
    with pytest.raises(ValueError, match="test_size"):
        harness.task_splits(task, replace(shape, eval_size=1000, test_size=256))


def test_evo_steps_must_divide_steps() -> None:
    args = harness.build_parser().parse_args(["compare", "--steps", "40", "--evo-steps", "3"])
    with pytest.raises(ValueError, match=r"--evo-steps \(3\) must divide --steps \(40\)"):
        harness.resolve_shape(args)
    args = harness.build_parser().parse_args(
        ["compare", "--evo-steps", "10", "--pbt", "{population: {selection: truncation}}"]
    )
    shape = harness.resolve_shape(args)
    assert shape.generations == 4 and shape.pbt == {"population": {"selection": "truncation"}}


def test_bootstrap_ci_and_the_target_censored_at_the_budget() -> None:
    mean, low, high = stats.bootstrap_ci([0.1, 0.2, 0.3, 0.4, 0.5])
    assert mean == pytest.approx(0.3) and 0.1 <= low < mean < high <= 0.5
    assert stats.bootstrap_ci([0.2, 0.2]) == (0.2, 0.2, 0.2)
    c = [
        stats.Curve("t", "pbt", 0, [8, 16], [0.6, 0.8], test_reward=0.7, wall_s=1),
        stats.Curve("t", "pbt", 1, [8, 16], [0.5, 0.6], test_reward=0.6, wall_s=1),
        stats.Curve("t", "random", 0, [8, 16], [0.4, 0.7], test_reward=0.5, wall_s=1),
        stats.Curve("t", "random", 1, [8, 16], [0.3, 0.5], test_reward=0.5, wall_s=1),
    ]
    summary = stats.summarize(c, "t", 0.7)
    assert summary["rows"]["pbt"]["reached"] == 1
    assert summary["rows"]["pbt"]["to_target_mean"] == pytest.approx((16 + 16) / 2)
    assert summary["rows"]["random"]["to_target"] == [16, math.inf]
    assert summary["diffs"]["pbt"]["random"]["diff"] == pytest.approx([0.2, 0.1])
    assert summary["diffs"]["pbt"]["random"]["wins"] == 2
    table = stats.format_summary(summary).splitlines()
    assert sum(line.startswith("| pbt |") for line in table) == 1


def _result(path: Path, seeds: list[int], target: float) -> Path:
    curves = [
        stats.Curve("t", s, seed, [8, 16], [0.4 + seed / 10, 0.6 + seed / 10], 0.5 + seed / 10)
        for seed in seeds
        for s in ("pbt", "random", "tpe")
    ]
    summary = stats.summarize(curves, "t", target)
    summary["tpe_trials"] = [{"trials": 10 + seed} for seed in seeds]
    shape = {"slots": 8, "steps": 16}
    path.write_text(
        json.dumps({"shape": shape, "curves": [asdict(c) for c in curves], "summaries": [summary]})
    )
    return path


def test_results_of_several_calls_merge_into_one_over_all_seeds(tmp_path: Path) -> None:
    a = _result(tmp_path / "a.json", [0], 0.5)
    b = _result(tmp_path / "b.json", [1, 2], 0.5)
    merged = stats.merge([b, a], {})
    (summary,) = merged["summaries"]
    assert summary["rows"]["pbt"]["seeds"] == [0, 1, 2]
    assert summary["rows"]["pbt"]["test"] == pytest.approx([0.5, 0.6, 0.7])
    assert [t["trials"] for t in summary["tpe_trials"]] == [10, 11, 12]  # in seed order
    assert summary["target"] == 0.5 and summary["rows"]["pbt"]["to_target"] == [16, 8, 8]
    assert stats.merge([a, b], {"t": 0.8})["summaries"][0]["rows"]["pbt"]["reached"] == 1
    with pytest.raises(ValueError, match=r"both hold \('t', 'pbt', 0\)"):
        stats.merge([a, _result(tmp_path / "c.json", [0], 0.5)], {})
    other = json.loads(b.read_text()) | {"shape": {"slots": 4, "steps": 16}}
    (tmp_path / "d.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="another shape"):
        stats.merge([a, tmp_path / "d.json"], {})


def test_the_sweep_envelope_is_the_first_depth_any_configuration_reaches_the_target(
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "sweep_cpu_t.txt"
    sweep.write_text(
        "t: warm start 0.5 (eval split, greedy); eval reward after 5, 10, 15 steps\n"
        "lr 0.001 temperature 1: 0.55 0.58 0.70\n"
        "lr 0.01 temperature 1: 0.60 0.66 0.10\n"
        "oracle: lr 0.001 temperature 1, best eval 0.70, test 0.69\n"
    )
    e = stats.envelope(sweep, 0.65, slots=8)
    assert e["best"] == [0.60, 0.66, 0.70]
    assert (e["depth"], e["config"], e["member_steps"]) == (10, "lr 0.01 temperature 1", 80)
    assert stats.envelope(sweep, 0.9, slots=8)["depth"] is None


@pytest.mark.integration
def test_real_campaigns_train_exactly_n_times_t_at_most_n_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the data-file task; what the builtin task loads is checked without campaigns
    (test_splits_are_disjoint_and_the_test_rows_are_not_written): the strategies and their
    accounting do not depend on the task."""
    task = "chain_sum"
    monkeypatch.setenv("PBT_CACHE_DIR", str(tmp_path / "cache"))
    s = MICRO
    data = harness.write_task_files(task, s, tmp_path / "data")
    model = harness.warm_model(task, s)
    groups, jobs = {}, []
    for strategy in harness.STRATEGIES:
        raws = harness.strategy_manifests(strategy, task, s, model, data, "cpu", 0)
        dirs = [tmp_path / f"{strategy}-{i}" for i in range(len(raws))]
        groups[strategy] = dirs
        jobs += list(zip(raws, dirs, strict=True))
    harness.run_campaigns(jobs, parallel=2, env=dict(os.environ, OMP_NUM_THREADS="1"))

    test_questions = {q for q, _ in harness.task_splits(task, s)["test"]}
    for strategy, dirs in groups.items():
        spent = [harness.spent(d) for d in dirs]
        assert sum(x["member_steps"] for x in spent) == s.slots * s.steps, strategy
        # generation by generation: the campaigns side by side never train more than N
        per_generation = [
            sum(col) for col in zip(*(x["members_per_generation"] for x in spent), strict=True)
        ]
        assert per_generation == [s.slots] * s.generations, strategy
        assert all(x["generations_in_order"] for x in spent), strategy
        assert sum(x["launches"] for x in spent) == s.slots * s.generations
        curve = harness.read_curve(dirs, task, strategy, 0)
        assert curve.steps == [s.slots * s.evo_steps * (g + 1) for g in range(s.generations)]
        for d in dirs:  # what the members trained and were selected on holds no test row
            with CampaignStore(d / STORE_FILENAME) as store:
                config = store.load_config()
            loaded = load_data(manifest_from_dict(config["manifest"], config["base_dir"]))
            seen = {e.question for e in loaded.eval} | {e.question for e in loaded.train}
            assert not seen & test_questions
            assert not (d / "test.json").exists()  # scored only after the campaign
        harness.score(dirs, curve, harness.task_splits(task, s)["test"])
        assert 0.0 <= curve.test_reward <= 1.0
    # re-scored on the eval split by the scorer that has loaded every campaign above, the best
    # member gives back the fitness its campaign recorded
    rescored = harness.best_member_reward(groups["pbt"][0], harness.task_splits(task, s)["eval"])
    with CampaignStore(groups["pbt"][0] / STORE_FILENAME) as store:
        assert (rescored["member"], rescored["eval_reward"]) == store.best()
    assert rescored["reward"] == pytest.approx(rescored["eval_reward"])
    tpe = groups["tpe"][0]
    with CampaignStore(tpe / STORE_FILENAME) as store:
        created = [m for m in store.members() if (m.mutation or "").startswith("trial")]
    assert len(created) >= s.slots  # each slot's first trial, and any started after a prune


def test_the_chain_sum_file_is_what_reasoning_gym_generates() -> None:
    pytest.importorskip("reasoning_gym")
    rows = proof_tasks.chain_sum_rows()
    assert rows == proof_tasks.generate_chain_sum_rows()
    assert len(rows) == len({q for q, _ in rows}) == 4000
