"""Zero signal and policy collapse, seen and acted on: the count of zero-signal steps in a row
(member state), the diagnosis in words, the figures in records and ``pbt status``, selection
replacing a collapsed member, and a member that collapses for a learning rate too high ended
early in a real campaign and in library mode."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
import subprocess
import sys

import pytest
import torch
import yaml
from support import small_manifest, small_sections

from pbt.algorithms.data.rewards import Reward, RewardTerm
from pbt.algorithms.runtime.member import Member
from pbt.controller.report import status_text
from pbt.controller.store import CampaignStore
from pbt.evolution.selection import TournamentSelection
from pbt.protocol.collapse import (
    COLLAPSE_HINT,
    ZERO_SIGNAL_HINT,
    diagnosis,
    signal_summary,
)
from pbt.protocol.records import MemberRecord

CPU = torch.device("cpu")
CONSTANT_REWARD = "def reward(completion, answer, question):\n    return 1.0\n"


def _record(slot: int, fitness: float, collapsed: bool = False) -> MemberRecord:
    return MemberRecord(
        member_id=f"g000-m{slot:02d}",
        generation=0,
        fitness_history=[fitness],
        status="done",
        collapsed=collapsed,
    )


def test_a_collapsed_member_is_never_elite_nor_a_tournament_winner():
    best_but_collapsed = _record(0, 0.9, collapsed=True)
    population = [best_but_collapsed, _record(1, 0.1)]
    selection = TournamentSelection(2, elitism=True, population_size=2)
    for seed in range(5):
        chosen = selection.select(population, random.Random(seed))
        assert [c.parent.member_id for c in chosen] == ["g000-m01", "g000-m01"]


def test_the_diagnosis_tells_policy_collapse_from_a_reward_without_spread():
    assert diagnosis({"skipped": 1.0, "identical_group_fraction": 0.0}) == ZERO_SIGNAL_HINT
    collapse = diagnosis({"skipped": 1.0, "identical_group_fraction": 1.0})
    assert collapse == COLLAPSE_HINT.format(share="all")
    assert "policy collapse" in collapse and "optim.lr" in collapse
    history = [
        {"zero_signal_fraction": 0.5, "skipped": 0.0, "identical_group_fraction": 0.5},
        {"zero_signal_fraction": 1.0, "skipped": 1.0, "identical_group_fraction": 1.0},
    ]
    assert signal_summary(history) == {
        "zero_signal_fraction": 1.0,
        "zero_signal_fraction_mean": 0.75,
        "zero_signal_steps": 1.0,
        "identical_group_fraction": 1.0,
    }
    assert signal_summary([{"loss": 0.1}]) == {}  # SFT and DPO have no groups


def test_store_keeps_collapse_and_figures_and_upgrades_an_older_store(tmp_path):
    # a store written before these columns existed gains them, its members not collapsed
    old = sqlite3.connect(tmp_path / "store.db")
    old.execute(
        "CREATE TABLE members (member_id TEXT PRIMARY KEY, generation INTEGER NOT NULL, "
        "parent_id TEXT, parent_checkpoint TEXT, hyperparameters TEXT NOT NULL, mutation TEXT, "
        "checkpoint TEXT, checkpoint_digest TEXT, fitness_history TEXT NOT NULL, "
        "last_fitness REAL, status TEXT NOT NULL, attempts INTEGER NOT NULL, "
        "steps INTEGER NOT NULL)"
    )
    old.execute(
        "INSERT INTO members VALUES ('g000-m00', 0, NULL, NULL, '{}', NULL, NULL, NULL, "
        "'[0.5]', 0.5, 'done', 1, 4)"
    )
    old.commit()
    old.close()
    with CampaignStore(tmp_path) as store:
        assert store.member("g000-m00").collapsed is False
        assert store.member("g000-m00").metrics == {}
        record = _record(1, 0.25, collapsed=True)
        record.metrics = {"zero_signal_fraction": 1.0, "zero_signal_fraction_mean": 0.6}
        store.add_members([record])
        assert store.member("g000-m01") == record
    table = status_text(tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("g000-m01"))
    assert "collapsed" in row and "0.60/1.00" in row and "0.2500" in row


def test_the_count_in_a_row_resets_on_signal_survives_save_and_load_and_ends_training(
    tmp_path,
):
    manifest = small_manifest(tmp_path, algorithm={"collapse_patience": 3})
    member = Member(manifest, CPU)
    learner = member.learner
    examples = learner.sample_prompts(member.task.train)
    batch, _ = learner.rollout(examples, member.task.reward)
    flat, spread = torch.full((8,), 0.5), torch.tensor([1.0, 0, 0, 0, 0, 1.0, 0, 0])
    metrics = learner.learn(batch, flat)
    assert learner.zero_signal_in_a_row == 1 and 0.0 <= metrics["identical_group_fraction"] <= 1
    learner.learn(batch, spread)
    assert learner.zero_signal_in_a_row == 0
    learner.learn(batch, flat)
    learner.learn(batch, flat)
    assert learner.zero_signal_in_a_row == 2 and not member.collapsed
    member.save(tmp_path / "ckpt")
    resumed = Member(manifest, CPU, host=member.host)
    resumed.load(tmp_path / "ckpt")
    assert resumed.learner.zero_signal_in_a_row == 2
    # a constant reward gives no signal: the resumed member collapses at its next step
    constant = Reward([RewardTerm("one", "a constant", lambda *_: 1.0)])
    resumed.task = dataclasses.replace(resumed.task, reward=constant)
    said: list[str] = []
    history = resumed.train(10, say=said.append)
    assert len(history) == 1 and resumed.collapsed and resumed.learner.step == 5
    assert history[0]["skipped"] == 1.0
    assert len([s for s in said if "identical rewards" in s]) == 1
    assert any("collapsed" in s and "collapse_patience = 3" in s for s in said)


def test_library_mode_ends_a_collapsed_member_and_selection_replaces_it(tmp_path, capsys):
    from pbt import create_population
    from pbt.library.loop import train_population

    (tmp_path / "flat.py").write_text(CONSTANT_REWARD)
    sections = small_sections(
        tmp_path,
        algorithm={"collapse_patience": 2},
        task={"reward": {"file": str(tmp_path / "flat.py"), "function": "reward"}},
        population={"tournament_size": 2},
    )
    pop = create_population(algo="GRPO", config=sections, population_size=2)
    pop = train_population(
        pop, steps=4, evo_steps=4, eval_every=4, output_dir=tmp_path / "lib", tracking=False
    )
    out = capsys.readouterr().out
    for agent in pop:
        assert agent.collapsed and agent.stopped and agent.steps == 2  # 2 of 4 steps
        assert out.count(f"{agent.member_id} step 1: every group") == 1
        assert f"{agent.member_id} step 2: collapsed" in out
        assert len(agent.fitness) == 1  # evaluated all the same
    # selection replaces a collapsed member, however good its measured fitness
    collapsed, healthy = pop[0], pop[1]
    healthy._member().learner.zero_signal_in_a_row = 0
    collapsed.fitness[-1], healthy.fitness[-1] = 1.0, 0.0
    pop.evolve()
    assert [agent.parent_id for agent in pop] == [healthy.member_id, healthy.member_id]


CAMPAIGN = {
    "model": {"name": "builtin:tiny"},
    "algorithm": {"group_size": 4, "prompts_per_step": 2, "collapse_patience": 3},
    # sampling at temperature 0.5 speeds the collapse up: at lr 0.05 the tiny model puts all
    # its mass on one completion within 5 to 8 steps (seeds 1 to 3, tried by hand)
    "rollout": {"max_output_tokens": 3, "temperature": 0.5},
    "optim": {"schedule": "constant"},
    "task": {"name": "builtin:letters", "eval_size": 8},
    # seed 9 draws lr 0.042 for g000-m00 (it collapses) and 0.0012 for g000-m01 (it learns)
    "training": {"seed": 9, "device": "cpu"},
    "population": {"size": 2, "tournament_size": 2, "evo_steps": 8, "init_sampler": "random"},
    "mutation": {
        "no_mutation": 1.0,
        "rl_hp": 0.0,
        "ranges": {"lr": {"min": 1e-3, "max": 5e-2, "log": True}},
    },
    "budget": {"generations": 2},
    "launch": {"slots": 2, "max_attempts": 1, "heartbeat_timeout_s": 120},
}


@pytest.mark.integration
def test_a_campaign_ends_a_collapsing_member_early_says_why_once_and_replaces_it(tmp_path):
    manifest = tmp_path / "collapse.yaml"
    manifest.write_text(yaml.safe_dump(CAMPAIGN))
    directory = tmp_path / "campaign"
    run = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "run", str(manifest), "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    with CampaignStore(directory / "store.db") as store:
        members = {m.member_id: m for m in store.members()}
        faults = store.faults()
    first, healthy = members["g000-m00"], members["g000-m01"]
    assert first.hyperparameters["lr"] > 0.03 > healthy.hyperparameters["lr"]
    assert first.collapsed and not healthy.collapsed
    assert first.metrics["trained_steps"] < CAMPAIGN["population"]["evo_steps"]
    assert first.steps == first.metrics["trained_steps"] and healthy.steps == 8
    assert first.metrics["zero_signal_fraction"] == 1.0 and first.fitness_history
    gen0 = [(f["member_id"], f["kind"]) for f in faults if f["generation"] == 0]
    assert gen0 == [("g000-m00", "collapsed")]  # (its replacements may collapse in turn)
    # selection replaced it: both members of generation 1 descend from the healthy one
    assert {members[m].parent_id for m in ("g001-m00", "g001-m01")} == {"g000-m01"}
    # the controller said why, once, in the words of policy collapse
    said = [line for line in out.splitlines() if line.startswith("  g000-m00 had no signal")]
    assert len(said) == 1 and "policy collapse" in said[0], out
    assert f"g000-m00 collapsed after {first.steps} of 8 steps" in out
    assert "zero-signal 0." in out and "(last 1.00)" in out
    status = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "status", str(directory)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "g000-m00 attempt 1: collapsed: no signal for 3 steps in a row" in status
    result = yaml.safe_load((directory / "tasks" / "g000-m00" / "result.json").read_text())
    assert result["fault"]["kind"] == "collapsed" and result["status"] == "ok"
    assert result["metrics"]["zero_signal_fraction_mean"] > 0


def test_pbt_train_reports_a_collapse_once_and_stops(tmp_path, capsys):
    """``pbt train`` on a member whose groups have no signal says why once, says it collapsed
    once, stops there as a campaign's task does, and still evaluates and saves it."""
    from pbt.worker.train import run_member

    (tmp_path / "flat.py").write_text(CONSTANT_REWARD)
    manifest = small_manifest(
        tmp_path,
        algorithm={"collapse_patience": 2},
        task={"reward": {"file": str(tmp_path / "flat.py"), "function": "reward"}},
        training={"steps": 8, "log_every": 1},
    )
    figures = run_member(manifest)
    out = capsys.readouterr().out
    assert out.count("every group in this batch got identical rewards") == 1
    assert out.count("collapsed") == 2, out  # the step that ended it, and the done line
    assert "step 2: collapsed: no signal for 2 steps in a row" in out
    assert "step    3/8" not in out  # no step after the collapse
    assert "done (collapsed: stopped at step 2 of 8): held-out reward" in out
    assert (tmp_path / "out" / "checkpoint").is_dir() and "final_reward" in figures
