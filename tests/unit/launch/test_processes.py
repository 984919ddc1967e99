"""Processes of campaigns on one machine: two campaigns started together never race for a
rendezvous port, a dead controller's workers end by themselves within a bound and ``pbt status``
says it is gone and what to run, and a resumed controller ends what its predecessor left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import (
    FAKE,
    FAKE_CAMPAIGN,
    TINY_CAMPAIGN,
    campaign_processes,
    start_campaign,
    wait_for_no_processes,
    write_manifest,
)

from pbt.cli.main import main
from pbt.controller.campaign import Campaign
from pbt.controller.report import status_text
from pbt.controller.store import CampaignStore
from pbt.launch.local import member_command
from pbt.launch.processes import end_campaign_processes
from pbt.protocol.controller import (
    CAMPAIGN_ENV,
    WATCH_S,
    controller_alive,
    controller_token,
    watch_controller,
)

MANIFEST = FAKE_CAMPAIGN
TORCHRUN_FAKE = [*member_command()[:-2], FAKE[1]]
"""The default member command (torchrun, its rendezvous included) with the fake member in place
of ``-m pbt.worker``."""
ROUNDS = 5


def _sleeper(env: dict[str, str]) -> subprocess.Popen:
    """A process in a session of its own with ``env`` added, as a member's rank runs."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, **env},
        start_new_session=True,
    )


def test_a_resumed_controller_ends_only_its_own_campaigns_processes(tmp_path):
    ours = [_sleeper({CAMPAIGN_ENV: str(tmp_path / "c")}) for _ in range(2)]
    other = _sleeper({CAMPAIGN_ENV: str(tmp_path / "c2")})  # a campaign whose name extends ours
    try:
        assert sorted(end_campaign_processes(tmp_path / "c")) == sorted(p.pid for p in ours)
        assert [p.wait(5) for p in ours] == [-signal.SIGKILL] * 2
        assert other.poll() is None
        assert end_campaign_processes(tmp_path / "c") == []
    finally:
        for p in [*ours, other]:
            p.kill()
            p.wait()


def test_a_controller_is_told_from_a_later_process_with_its_pid(tmp_path):
    assert controller_alive(controller_token())
    child = _sleeper({})
    token = f"{child.pid}:{Path(f'/proc/{child.pid}/stat').read_text().split()[21]}"
    assert controller_alive(token)
    assert not controller_alive(f"{child.pid}:1")  # the same pid, another start: not it
    child.kill()
    child.wait()
    assert not controller_alive(token)
    assert controller_alive("garbled")  # nothing is ended on a guess


def test_a_watched_controllers_death_is_seen_within_the_bound(monkeypatch):
    child = _sleeper({})
    start = Path(f"/proc/{child.pid}/stat").read_text().split()[21]
    monkeypatch.setenv("PBT_CONTROLLER", f"{child.pid}:{start}")
    seen: list[tuple[int, float]] = []
    assert watch_controller(lambda pid: seen.append((pid, time.monotonic())), every_s=0.05)
    time.sleep(0.3)
    assert seen == []
    child.kill()
    child.wait()
    killed = time.monotonic()
    deadline = killed + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and seen[0][0] == child.pid and seen[0][1] - killed < 1.0


def test_status_tells_a_running_controller_from_a_gone_one(tmp_path):
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST)
    directory = tmp_path / "c"
    campaign = Campaign.start(manifest, directory, member_command=["true"])
    try:
        for m in campaign.store.members(0):
            m.status, m.attempts = "running", 1
            campaign.store.update_member(m)
        live = status_text(directory)
    finally:
        campaign.close()
    gone = status_text(directory)
    rows = {text: [line.split()[2] for line in text.splitlines() if line.startswith("g000-")]
            for text in (live, gone)}  # fmt: skip
    assert "controller:" not in live and "\nrunning:\n" in live
    assert set(rows[live]) == {"running"} and set(rows[gone]) == {"interrupted"}
    assert f"controller: none running (the last was pid {os.getpid()} on " in gone
    assert "\nlast seen running:\n" in gone


@pytest.mark.integration
def test_two_campaigns_started_together_never_race_for_a_port(tmp_path):
    """Two campaigns on long-lived workers (torchrun agents, the default command), started in
    the same instant, ``ROUNDS`` times: every member of both trains at its first attempt."""
    launch = {"persistent_workers": True, "slots": 2, "heartbeat_timeout_s": 60}
    faults = []
    for round_ in range(ROUNDS):
        directories = [tmp_path / f"{round_}{name}" / "campaign" for name in ("a", "b")]
        manifests = []
        for directory in directories:
            directory.parent.mkdir()
            path = directory.parent / "manifest.yaml"
            manifests.append(
                write_manifest(path, MANIFEST, budget={"generations": 1}, launch=launch)
            )
        procs = [
            start_campaign(manifest, directory, TORCHRUN_FAKE, 0.05, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
            for manifest, directory in zip(manifests, directories, strict=True)
        ]  # fmt: skip
        for proc in procs:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err.decode()[-2000:]
        for directory in directories:
            with CampaignStore(directory / "store.db") as store:
                faults += [(directory.parent.name, f["kind"], f["detail"]) for f in store.faults()]
                assert {m.attempts for m in store.members(0)} == {1}
    assert faults == []


@pytest.mark.integration
def test_a_dead_controllers_workers_end_and_status_says_what_to_run(tmp_path, capsys):
    """SIGKILL the controller of a campaign of real members on long-lived workers while a member
    trains: its worker group (torchrun's agent and its rank, in sessions of their own) ends
    within a few seconds, with no resume; ``pbt status`` says the controller is gone and how to
    go on, and shows the member interrupted, not running."""
    manifest = write_manifest(
        tmp_path / "manifest.yaml",
        TINY_CAMPAIGN,
        population={"size": 2},
        budget={"generations": 1},
        launch={"slots": 1, "persistent_workers": True},
    )
    directory = tmp_path / "campaign"
    proc = start_campaign(
        manifest, directory, member_command(), 0.0, {"OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        heartbeat = directory / "tasks" / "g000-m00" / "heartbeat"
        deadline = time.monotonic() + 180
        while not heartbeat.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no member started"
            time.sleep(0.05)
        assert len(campaign_processes(directory)) >= 2  # the worker's agent and its rank
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        left = wait_for_no_processes(directory, within_s=WATCH_S + 20)
        assert left == [], left
        took = time.monotonic() - killed
        assert main(["status", str(directory)]) == 0
    finally:
        proc.kill()
        for line in campaign_processes(directory):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
    out = capsys.readouterr().out
    assert (
        f"controller: none running (the last was pid {proc.pid} on {socket.gethostname()}), and "
        f"the campaign has work left: continue it with: pbt resume {directory}"
    ) in out, out
    [row] = [line for line in out.splitlines() if line.startswith("g000-m00 ")]
    assert row.split()[2] == "interrupted", out
    assert "last seen running:\n  g000-m00  " in out
    assert (directory / "workers" / "slot0" / "worker.log").read_text().count(
        f"the controller (pid {proc.pid}) has ended; this worker stops"
    ) == 1
    print(f"the dead controller's worker group ended {took:.1f} s after it")
