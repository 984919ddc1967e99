"""Optuna in campaigns: the initial samplers, warm starts, and the Optuna strategy (trials from
scratch, pruned and replaced), with the fake member so each campaign takes seconds."""

from __future__ import annotations

import json
import math
import sys
import urllib.request
from pathlib import Path

import pytest
from support import DRIVERS, MlflowServer, killed_and_resumed, write_manifest

from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore
from pbt.evolution.breeding import INIT_STUDY
from pbt.evolution.trials import POPULATION_STUDY, SEARCH_STUDY

pytestmark = pytest.mark.integration  # each test runs real processes (controller, members)

FAKE = [sys.executable, str(DRIVERS / "fake_member.py")]
MANIFEST = {
    "INIT_HP": {"TOURNAMENT_SIZE": 2, "EVO_STEPS": 2, "LR": 1e-4},
    "mutation": {"ranges": {"lr": {"min": 1e-5, "max": 1e-1, "log": True}}},
    "budget": {"generations": 4},
    "population": {"size": 4},
    "launch": {"slots": 4, "persistent_workers": False},
    "training": {"seed": 5},
    "tracking": {"enabled": False},
}


def _run(tmp_path: Path, name: str, **changes) -> Path:
    path = write_manifest(tmp_path / f"{name}.yaml", MANIFEST, **changes)
    campaign = Campaign.start(path, tmp_path / name, member_command=FAKE)
    campaign.say = lambda *_: None
    try:
        campaign.run()
    finally:
        campaign.close()
    return tmp_path / name


def _members(directory: Path):
    with CampaignStore(directory / "store.db") as store:
        return store.members()


def _study(directory: Path, name: str):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{directory}/optuna.db")


def test_qmc_population_is_spread_and_recorded_for_warm_starts(tmp_path):
    first = _run(tmp_path, "a", population={"init_sampler": "qmc", "size": 8})
    lrs = [m.hyperparameters["lr"] for m in _members(first) if m.generation == 0]
    assert all(1e-5 <= lr <= 1e-1 for lr in lrs)
    decades = {math.floor(math.log10(lr)) for lr in lrs}
    assert len(decades) >= 3  # log scale: spread over orders of magnitude
    study = _study(first, INIT_STUDY)
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 8
    # every trained PBT member is a trial of the population study (for optuna-dashboard)
    assert len(_study(first, POPULATION_STUDY).trials) == len(_members(first))
    # a second campaign warm-starts TPE from the first one's study
    second = _run(
        tmp_path, "b", population={"init_sampler": "tpe", "warm_start": str(first), "size": 4}
    )
    trials = _study(second, INIT_STUDY).trials
    assert len(trials) == 8 + 4  # the first campaign's history, then this one's draws
    near = [abs(math.log10(m.hyperparameters["lr"]) - math.log10(3e-3)) for m in _members(second)]
    assert min(near) < 1.0  # the fake member's best lr is 3e-3


def test_optuna_strategy_prunes_and_replaces_trials(tmp_path):
    search = {
        "strategy": "optuna",
        "sampler": "random",
        "pruner": "median",
        "trial_generations": 3,
        "startup_trials": 2,
    }
    directory = _run(tmp_path, "s", search=search, budget={"generations": 8})
    members = _members(directory)
    study = _study(directory, SEARCH_STUDY)
    by_member = {t.user_attrs["member_id"]: t for t in study.trials}
    roots = [m for m in members if m.parent_id is None]
    assert set(by_member) == {m.member_id for m in roots}  # one trial per from-scratch member
    states = [t.state.name for t in study.trials]
    assert states.count("PRUNED") >= 1 and states.count("COMPLETE") >= 4
    assert "RUNNING" not in states  # the budget's end completes the trials still running
    for t in study.trials:
        # one intermediate value per generation trained; a pruned trial trained fewer
        steps = sorted(t.intermediate_values)
        assert steps == list(range(len(steps))) and 1 <= len(steps) <= 3
        if t.state.name == "PRUNED":
            assert len(steps) < 3
    # a slot whose trial stopped starts a new trial from scratch, with the trial's values
    for m in members:
        if m.parent_id is None:
            assert by_member[m.member_id].params["lr"] == pytest.approx(m.hyperparameters["lr"])
            assert m.generation == 0 or m.fitness_history == [] or len(m.fitness_history) == 1
    # resume of a finished campaign asks nothing new
    count = len(study.trials)
    campaign = Campaign.resume(directory, member_command=FAKE)
    campaign.close()
    assert len(_study(directory, SEARCH_STUDY).trials) == count


def test_optuna_dashboard_shows_the_campaign_studies(tmp_path):
    directory = _run(
        tmp_path,
        "d",
        search={"strategy": "optuna", "sampler": "tpe", "trial_generations": 2},
        budget={"generations": 3},
    )
    command = [
        sys.executable,
        "-m",
        "pbt.cli",
        "dashboard",
        str(directory),
        "--port",
        "{port}",
    ]
    server = MlflowServer(tmp_path, command, health="/api/studies")
    try:
        server.start()
        with urllib.request.urlopen(f"{server.uri}/api/studies", timeout=10) as response:
            studies = json.load(response)["study_summaries"]
        (search,) = [s for s in studies if s["study_name"] == SEARCH_STUDY]
        detail = f"{server.uri}/api/studies/{search['study_id']}"
        with urllib.request.urlopen(detail, timeout=10) as response:
            trials = json.load(response)["trials"]
    finally:
        server.stop()
    assert len(trials) == len(_study(directory, SEARCH_STUDY).trials) >= 4
    assert all("lr" in {p["name"] for p in t["params"]} for t in trials)


def test_killed_optuna_campaign_resumes_to_the_same_trials(tmp_path):
    search = {"strategy": "optuna", "sampler": "tpe", "trial_generations": 2, "startup_trials": 2}
    straight = _run(tmp_path, "straight", search=search, budget={"generations": 6})
    manifest = write_manifest(
        tmp_path / "killed.yaml", MANIFEST, search=search, budget={"generations": 6}
    )
    directory = killed_and_resumed(manifest, tmp_path / "killed")

    def decisions(d):
        return [
            (m.member_id, m.parent_id, m.hyperparameters, m.fitness_history) for m in _members(d)
        ]

    def trials(d):
        study = _study(d, SEARCH_STUDY)
        return [(t.user_attrs["member_id"], t.params, t.state.name) for t in study.trials]

    assert decisions(directory) == decisions(straight)
    assert trials(directory) == trials(straight)


def test_pb2_campaign_finds_the_peak_and_resumes_to_the_same_choices(tmp_path):
    """``search.strategy: pb2`` on the fake member (gain peaks at lr 3e-3): copies take the
    bandit's choices, which end nearer the peak than generation 0's draws; a controller killed
    mid-campaign resumes to the same choices."""
    changes = {
        "search": {"strategy": "pb2"},
        "population": {"size": 8, "selection": "truncation", "init_sampler": "random"},
        "launch": {"slots": 4, "persistent_workers": False},
        "budget": {"generations": 5},
    }
    straight = _run(tmp_path, "straight", **changes)
    members = _members(straight)
    copies = [m for m in members if (m.mutation or "").startswith("pb2 (lr ")]
    assert len(copies) == 2 * 4  # two copies a generation after generations 0 to 3

    def off_peak(m) -> float:
        return abs(math.log10(m.hyperparameters["lr"]) - math.log10(3e-3))

    initial = [off_peak(m) for m in members if m.generation == 0]
    assert sum(off_peak(m) for m in copies) / len(copies) < sum(initial) / len(initial) / 2

    manifest = write_manifest(tmp_path / "killed.yaml", MANIFEST, **changes)
    directory = killed_and_resumed(manifest, tmp_path / "killed")

    def decisions(d):
        return [(m.member_id, m.parent_id, m.hyperparameters, m.mutation) for m in _members(d)]

    assert decisions(directory) == decisions(straight)
