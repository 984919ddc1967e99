"""The controller with a small fake member program: selection, mutation, lineage, resume,
lock, retries, replacement and garbage collection, in seconds."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import FAKE, FAKE_CAMPAIGN, decisions, start_campaign, write_manifest

from pbt.config.errors import PbtError
from pbt.controller.campaign import Campaign
from pbt.controller.report import lineage_png, lineage_text, status_text
from pbt.controller.store import CampaignStore

pytestmark = pytest.mark.integration  # each test runs real processes (controller, members)

MANIFEST = FAKE_CAMPAIGN


def _manifest(tmp_path: Path, **changes) -> Path:
    return write_manifest(tmp_path / "manifest.yaml", MANIFEST, **changes)


def _run(manifest: Path, directory: Path, faults: dict | None = None):
    campaign = Campaign.start(manifest, directory, member_command=FAKE)
    if faults:
        (directory / "faults.json").write_text(json.dumps(faults))
    campaign.say = lambda *_: None
    try:
        return campaign.run()
    finally:
        campaign.close()


def test_campaign_evolves_and_records_lineage(tmp_path):
    summary = _run(_manifest(tmp_path), tmp_path / "c")
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        members = store.members()
        lineage = store.lineage()
    assert summary.generations == 5 and summary.stop_reason == "5 generations done"
    assert {m.generation for m in members} == {0, 1, 2, 3, 4}
    assert all(m.status == "done" for m in members)
    best_by_gen = [
        max(m.fitness_history[-1] for m in members if m.generation == g) for g in range(5)
    ]
    assert best_by_gen == sorted(best_by_gen) and best_by_gen[-1] > best_by_gen[0] + 1.0
    for m in members:
        assert 1e-5 <= m.hyperparameters["lr"] <= 1e-1
        if m.generation:
            parent = next(p for p in members if p.member_id == m.parent_id)
            assert parent.generation == m.generation - 1
            assert m.fitness_history[:-1] == parent.fitness_history  # history carried over
    kinds = {e["kind"] for e in lineage}
    assert {"create", "elite"} <= kinds and kinds & {"mutate", "clone"}
    elites = [m for m in members if m.mutation == "none (elite)"]
    assert len(elites) == 4  # one per generation after the first


def test_same_seed_same_decisions_other_seed_others(tmp_path):
    _run(_manifest(tmp_path), tmp_path / "a")
    _run(_manifest(tmp_path), tmp_path / "b")
    assert decisions(tmp_path / "a") == decisions(tmp_path / "b")
    _run(_manifest(tmp_path, training={"seed": 8}), tmp_path / "c")
    assert decisions(tmp_path / "a") != decisions(tmp_path / "c")


def test_failed_member_is_retried_then_replaced(tmp_path):
    faults = {"g001-m01": ["exit1", "ok"], "g002-m02": ["sigkill", "exit1"]}
    _run(_manifest(tmp_path), tmp_path / "c", faults)
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        recorded = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        retried, replaced = store.member("g001-m01"), store.member("g002-m02")
        best_of_gen2 = max(
            (m for m in store.members(2) if m.member_id != "g002-m02"), key=lambda m: m.fitness()
        )
    assert ("g001-m01", 1, "failed") in recorded
    assert retried.status == "done" and retried.attempts == 2
    assert [r for r in recorded if r[0] == "g002-m02"] == [
        ("g002-m02", 1, "failed"),
        ("g002-m02", 2, "failed"),
        ("g002-m02", 2, "replaced"),
    ]
    assert replaced.status == "done" and replaced.checkpoint == best_of_gen2.checkpoint
    assert "replaced by a clone of" in replaced.mutation
    text = status_text(tmp_path / "c")
    assert "faults (4)" in text and "killed by SIGKILL" in text


def test_a_hung_member_is_detected_by_its_heartbeat(tmp_path):
    manifest = _manifest(tmp_path, launch={"heartbeat_timeout_s": 1.5}, budget={"generations": 2})
    (tmp_path / "c").mkdir()
    campaign = Campaign.start(manifest, tmp_path / "c", member_command=FAKE)
    campaign.say = lambda *_: None
    # a member that never heartbeats: a program that sleeps without touching its heartbeat
    campaign.member_command = [sys.executable, "-c", "import sys, time; time.sleep(60)"]
    campaign.manifest.launch.max_attempts = 1
    with pytest.raises(PbtError, match="no member of generation 0 finished"):
        campaign.run()
    campaign.close()
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        assert {f["kind"] for f in store.faults()} == {"no_heartbeat"}


def test_checkpoints_on_disk_stay_bounded(tmp_path):
    """Over 12 generations, the checkpoint folders on disk never exceed population (4) + elites
    (1) + in flight (4): counted after every generation's garbage collection (between
    generations, only the parents and the best are left), and sampled every few milliseconds
    all along."""
    directory = tmp_path / "c"
    campaign = Campaign.start(
        _manifest(tmp_path, budget={"generations": 12}), directory, member_command=FAKE
    )
    folder = directory / "checkpoints"
    after_gc: list[int] = []

    def count() -> int:
        return len(list(folder.iterdir())) if folder.exists() else 0

    def say(line: str) -> None:  # "generation N: training" follows generation N-1's collection
        if line.startswith("generation ") and ": training" in line:
            after_gc.append(count())

    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            with contextlib.suppress(FileNotFoundError):
                samples.append(count())

    sampler = threading.Thread(target=sample)
    sampler.start()
    campaign.say = say
    try:
        campaign.run()
    finally:
        campaign.close()
        done.set()
        sampler.join()
    after_gc.append(count())
    assert len(after_gc) == 13 and len(samples) > 100
    bound = 4 + 1 + 4
    assert max(after_gc) <= bound and max(samples) <= bound, (after_gc, max(samples))
    assert max(after_gc[1:-1]) <= 4 + 1, after_gc  # between generations: the parents and the best
    on_disk = sorted(p.name for p in folder.iterdir())
    with CampaignStore(directory / "store.db") as store:
        best = store.best()
        latest = {m.checkpoint for m in store.members(11)}
    assert {Path(p).name for p in latest if p} <= set(on_disk)
    assert best[0] in on_disk


def test_second_controller_is_refused_and_dirs_are_checked(tmp_path):
    manifest = _manifest(tmp_path)
    first = Campaign.start(manifest, tmp_path / "c", member_command=FAKE)
    with pytest.raises(PbtError, match="another controller is running"):
        Campaign.resume(tmp_path / "c", member_command=FAKE)
    first.close()
    with pytest.raises(PbtError, match="already holds a campaign"):
        Campaign.start(manifest, tmp_path / "c")
    with pytest.raises(PbtError, match="holds no campaign"):
        Campaign.resume(tmp_path / "nothing")


def test_killed_controller_resumes_to_the_same_decisions(tmp_path):
    manifest = _manifest(tmp_path, budget={"generations": 6})
    _run(manifest, tmp_path / "straight")
    directory = tmp_path / "killed"
    proc = start_campaign(manifest, directory, FAKE, 0.3, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill mid-generation 2, members running
        if (directory / "tasks" / "g002-m01" / "heartbeat").exists():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with CampaignStore(directory / "store.db") as store:
        assert store.last_committed_generation() == 1
    resumed = Campaign.resume(directory, member_command=FAKE)
    resumed.say = lambda *_: None
    resumed.run()
    resumed.close()
    assert decisions(directory) == decisions(tmp_path / "straight")


def test_status_and_lineage_views(tmp_path):
    summary = _run(_manifest(tmp_path, budget={"generations": 3}), tmp_path / "c")
    status = status_text(tmp_path / "c")
    assert "generation 2" in status and "g002-m00" in status and "lr" in status
    tree = lineage_text(tmp_path / "c")
    assert tree.count("generation ") == 3 and "<- base model" in tree
    ancestry = lineage_text(tmp_path / "c", summary.best_member)
    assert ancestry.splitlines()[0].strip().startswith("gen 0")
    png = lineage_png(tmp_path / "c", tmp_path / "lineage.png")
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("budget", "reason", "generations"),
    [
        ({"generations": 50, "target_fitness": 2.0}, "target fitness 2.0 reached", None),
        ({"generations": 50, "total_steps": 30}, "30 total steps done", 3),
        ({"generations": 50, "wall_time_s": 0.5}, "wall time 0.5 s spent", None),
        ({"generations": 50, "gpu_hours": 1e-4}, "0.0001 GPU-hours spent", 1),
    ],
)
def test_budget_stops_the_campaign(tmp_path, budget, reason, generations):
    # gpus_per_member 1 makes every member-second count as a GPU-second (the fake needs no GPU)
    launch = {"gpus_per_member": 1, "gpu_ids": [0, 1]}
    summary = _run(_manifest(tmp_path, budget=budget, launch=launch), tmp_path / "c")
    assert summary.stop_reason == reason
    if generations is not None:  # 4 members x 3 steps a generation: 30 steps after 3 generations
        assert summary.generations == generations
    else:
        assert summary.generations < 50
    if "target" in reason:
        assert summary.best_fitness >= 2.0


CRASHES = [
    "launch:1", "launch:3", "task:1", "task:6", "selection:1", "selection:3",
    "store:1", "store:3", "gc:1", "gc:4",
]  # fmt: skip


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The campaign the crash tests compare with, run without interruption."""
    root = tmp_path_factory.mktemp("straight")
    manifest = _manifest(root, budget={"generations": 4})
    _run(manifest, root / "campaign")
    return manifest, root / "campaign"


@pytest.mark.parametrize("crash", CRASHES)
def test_controller_killed_at_any_point_resumes_to_the_same_campaign(tmp_path, straight_run, crash):
    """SIGKILL the controller at a crash point (see pbt.protocol.crash), resume: the same lineage,
    hyperparameters and fitness as the uninterrupted run, and the same checkpoints on disk,
    none orphaned, none missing."""
    manifest, straight = straight_run
    directory = tmp_path / "crashed"
    env = {"PBT_CRASH_AT": crash}
    proc = start_campaign(manifest, directory, FAKE, 0.05, env, stdout=subprocess.DEVNULL)
    assert proc.wait(timeout=120) == -signal.SIGKILL, f"{crash} was never reached"
    resumed = Campaign.resume(directory, member_command=FAKE)
    resumed.say = lambda *_: None
    try:
        resumed.run()
    finally:
        resumed.close()
    assert decisions(directory) == decisions(straight)
    on_disk = {p.name for p in (directory / "checkpoints").iterdir()}
    assert on_disk == {p.name for p in (straight / "checkpoints").iterdir()}
    with CampaignStore(directory / "store.db") as store:
        assert store.unreferenced_checkpoints() == []
