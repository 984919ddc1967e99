"""Proof of value III's harness: its tasks' splits, every strategy's manifest, the
pre-registered statistics, and a short dry run of one seed on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import proof_stats  # noqa: E402
import proof_v3  # noqa: E402
import proof_v3_tasks  # noqa: E402

from pbt.config.read.loader import manifest_from_dict  # noqa: E402


def test_difficulties_are_disjoint_and_split_by_the_question_alone() -> None:
    splits = proof_v3_tasks.task_splits("S", 1023, 4095)
    assert [len(s["eval"]) for s in splits] == [341] * 3
    assert [len(s["test"]) for s in splits] == [1365] * 3
    for digits, s in zip(proof_v3_tasks.DIGITS, splits, strict=True):
        questions = {name: {q for q, _ in s[name]} for name in ("train", "eval", "test")}
        assert not questions["train"] & questions["eval"]
        assert not (questions["train"] | questions["eval"]) & questions["test"]
        q, a = s["test"][0]
        terms = [int(t) for t in q.removeprefix("What is ").rstrip("?").split(" + ")]
        assert all(len(str(t)) == digits for t in terms) and sum(terms) == int(a)
    assert proof_v3_tasks.task_splits("S", 1023, 4095) == splits  # generated the same again
    assert proof_v3_tasks.stage_ends(48) == [16, 32]


@pytest.mark.parametrize("task", proof_v3_tasks.TASKS)
def test_every_strategys_manifest_is_valid(tmp_path, task) -> None:
    # the real model is fetched on a GPU machine only: its shape with the tiny model here
    shape = dataclasses.replace(proof_v3.SHAPES["h200"], model="builtin:tiny")
    m = proof_v3.base_manifest(task, shape, 0, "cuda", tmp_path / "data")
    grid = {"lr": 3.0e-4, "schedule": "cosine", "temperature": 1.0}
    counts = {}
    for strategy in proof_v3.STRATEGIES:
        manifests = proof_v3.strategy_manifests(strategy, m, 0, grid)
        counts[strategy] = len(manifests)
        for one in manifests:
            manifest = manifest_from_dict(one, base_dir=tmp_path)
            assert manifest.training.steps == shape.steps  # the cosine's horizon is T
    assert counts["manual3"] == 3 and counts["hand_schedule"] == 0 and counts["pbt"] == 1
    if task == "S":
        stages = m["task"]["stages"]
        assert [s["until_step"] for s in stages] == [16, 32, None]
        assert m["task"]["replay"] == 0.2


def test_the_statistics_match_scipy_and_holm() -> None:
    diffs = [0.05, 0.02, -0.01, 0.04, 0.03, 0.06, 0.01]
    assert proof_stats.wilcoxon_p(diffs) == pytest.approx(proof_stats._exact_wilcoxon(diffs))
    assert proof_stats._exact_wilcoxon([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx(2 / 32)
    mean, low, high = proof_stats.paired_t_interval(diffs)
    assert low < mean < high and low > 0
    assert proof_stats.holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx(
        {"a": 0.03, "c": 0.06, "b": 0.06}
    )
    assert proof_stats.wins_ties_losses([0.1, 0.0, -0.2, 0.3]) == (2, 1, 1)


@pytest.mark.integration
def test_a_dry_run_of_one_seed(tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    stage0 = {"grid_fixed": {"lr": 1.0e-3, "schedule": "cosine", "temperature": 1.0}}
    (out / "stage0.json").write_text(json.dumps(stage0))
    command = [
        sys.executable, str(BENCH / "proof_v3.py"), "seed", "--task", "S", "--seed", "0",
        "--shape", "micro", "--device", "cpu", "--strategies", "mfpbt,grid_fixed,hand_schedule",
        "--work-dir", str(tmp_path / "work"), "--out", str(out), "--grid", str(out / "stage0.json"),
    ]  # fmt: skip
    subprocess.run(command, check=True, timeout=600)
    result = json.loads((out / "S-s0.json").read_text())
    micro = proof_v3.SHAPES["micro"]
    strategies = result["strategies"]
    assert set(strategies) == {"mfpbt", "grid_fixed", "hand_schedule"}
    assert strategies["mfpbt"]["member_steps"] == micro.slots * micro.steps
    assert strategies["grid_fixed"]["member_steps"] == micro.steps
    for r in strategies.values():
        assert len(r["by_difficulty"]) == 3 and 0 <= r["macro"] <= 1
    curve = strategies["mfpbt"]["curve"]
    assert curve["member_steps"][-1] == micro.slots * micro.steps
    assert len(curve["best_eval"]) == len(curve["seconds"]) == micro.steps // micro.evo_steps
    assert curve["seconds"] == sorted(curve["seconds"]) and curve["seconds"][0] > 0


@pytest.mark.integration
def test_the_best_members_trajectory_is_one_value_set_per_generation(tmp_path) -> None:
    """The schedule replay's input, read from a real campaign's store (the fake member)."""
    from support import EXPLORE_CAMPAIGN as MANIFEST
    from support import FAKE, write_manifest
    from support import members as _members

    from pbt.controller.campaign import Campaign

    path = write_manifest(tmp_path / "m.yaml", MANIFEST)
    campaign = Campaign.start(path, tmp_path / "pbt-0", member_command=FAKE)
    campaign.say = lambda *_: None
    campaign.run()
    campaign.close()
    chain = proof_v3.trajectory(tmp_path / "pbt-0")
    members = {m.member_id: m for m in _members(tmp_path / "pbt-0")}
    best = max(members.values(), key=lambda m: m.fitness_history[-1])
    assert len(chain) == best.generation + 1
    assert chain[-1] == best.hyperparameters
    record, expected = best, []
    while record is not None:
        expected.append(record.hyperparameters)
        record = members.get(record.parent_id) if record.parent_id else None
    assert chain == expected[::-1] and len(chain) == 5  # the best is of the last generation
