"""A campaign whose long-lived worker trains ``launch.members_per_batch`` members at once (one
batched rollout a step, each member learning in turn) against the same campaign one member at a
time on the same worker: the same decisions and the same checkpoints, bit for bit; and a
campaign of two such workers whose controller is SIGKILLed mid-generation resumes to the same
decisions."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import TINY_CAMPAIGN

from pbt.controller.store import CampaignStore

pytestmark = pytest.mark.integration

PBT = [sys.executable, "-m", "pbt.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every run: the same sums


def _manifest(directory: Path, per_batch: int, slots: int = 1) -> Path:
    launch = {**TINY_CAMPAIGN["launch"], "slots": slots, "persistent_workers": True}
    data = {
        **TINY_CAMPAIGN,
        "budget": {"generations": 2},
        "launch": {**launch, "members_per_batch": per_batch},
    }
    path = directory / f"batch{per_batch}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(manifest: Path, directory: Path, env: dict[str, str] = ENV) -> None:
    proc = subprocess.run(
        [*PBT, "run", str(manifest), "--dir", str(directory)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def _members(directory: Path) -> list[tuple]:
    with CampaignStore(directory / "store.db") as store:
        return [
            (m.member_id, m.parent_id, m.hyperparameters, m.mutation, m.fitness_history, m.status,
             m.checkpoint_digest)
            for m in store.members()
        ]  # fmt: skip


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    root = tmp_path_factory.mktemp("one")
    _run(_manifest(root, 1), root / "campaign")
    return _members(root / "campaign")


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batched")
    # checkpoints written as slowly as a GPU member's (1.5 s): the next generation's first
    # tasks are handed ahead long before the last write ends
    _run(_manifest(root, 2), root / "campaign", {**ENV, "PBT_DELAY_AT": "checkpoint_write:1.5"})
    return root / "campaign"


def test_members_in_one_batch_equal_members_one_at_a_time(one_at_a_time, batched):
    assert _members(batched) == one_at_a_time
    # every task ran in a batch of two: its log holds its batch-mate's steps too; in the
    # generations after the first as well, whose first tasks are handed ahead to the worker
    # while the last checkpoints are written (two of them, or the first would run alone)
    for generation in range(2):
        for log in (batched / "logs").glob(f"g{generation:03d}-*.log"):
            text = log.read_text()
            mates = {f"g{generation:03d}-m{i:02d}" for i in range(4)} - {log.name.split(".")[0]}
            assert any(f"{mate} step" in text for mate in mates), (log.name, text[-2000:])


def test_a_killed_batched_campaign_resumes_to_the_same_decisions(one_at_a_time, tmp_path: Path):
    """Two workers batching two members each, the controller SIGKILLed mid-generation."""
    manifest, directory = _manifest(tmp_path, 2, slots=2), tmp_path / "killed"
    proc = subprocess.Popen(
        [*PBT, "run", str(manifest), "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        env={**ENV, "PBT_CRASH_AT": "task:6"},  # generation 1's second task started
    )
    assert proc.wait(timeout=600) == -signal.SIGKILL
    with CampaignStore(directory / "store.db") as store:
        assert store.last_committed_generation() == 0
    resumed = subprocess.run(
        [*PBT, "resume", str(directory)], capture_output=True, text=True, timeout=600, env=ENV
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _members(directory) == one_at_a_time
