"""Resume after a crash: the controller lock never outlives its controller, and a controller's
process group killed at any moment resumes at once to the same campaign."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import write_manifest
from test_campaign import FAKE, MANIFEST

from pbt.config.errors import PbtError
from pbt.controller.campaign import Campaign
from pbt.controller.lock import ControllerLock, controller_running
from pbt.controller.store import CampaignStore

MANIFEST = {**MANIFEST, "launch": {**MANIFEST["launch"], "slots": 4}}  # a generation at once


def _run(campaign: Campaign):
    campaign.say = lambda *_: None
    try:
        return campaign.run()
    finally:
        campaign.close()


def _campaign(directory: Path) -> list[tuple]:
    """Every decision of the campaign in ``directory``: members (parent, hyperparameters,
    mutation, fitness), lineage events in order, and the checkpoints left on disk."""
    with CampaignStore(directory / "store.db") as store:
        members = [
            (m.member_id, m.parent_id, json.dumps(m.hyperparameters, sort_keys=True), m.mutation,
             m.fitness_history)
            for m in store.members()
        ]  # fmt: skip
        events = [
            (e["generation"], e["member_id"], e["parent_id"], e["kind"]) for e in store.lineage()
        ]
        assert store.unreferenced_checkpoints() == []
    on_disk = sorted(p.name for p in (directory / "checkpoints").iterdir())
    return [members, events, on_disk]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A four-generation campaign run without interruption: (its manifest, its directory)."""
    root = tmp_path_factory.mktemp("straight")
    manifest = write_manifest(root / "manifest.yaml", MANIFEST, budget={"generations": 4})
    _run(Campaign.start(manifest, root / "campaign", member_command=FAKE))
    return manifest, root / "campaign"


# -- the lock ----------------------------------------------------------------------------------

_HOLD = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, sys.argv[2].encode())
print("held", flush=True)
time.sleep(60)
"""
"""A process that is no controller holding the lock with a given record, as a descriptor kept
by another process would."""


def _holding(path: Path, record: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), json.dumps(record)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def _start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


@pytest.mark.parametrize("holder", ["ended", "pid reused", "not a controller"])
def test_a_stale_lock_is_taken_over_in_one_line(tmp_path, holder):
    host = socket.gethostname()
    other = subprocess.Popen(["sleep", "60"])
    if holder == "ended":
        gone = subprocess.Popen(["true"])
        gone.wait()
        record, says = {"pid": gone.pid, "start_time": 1, "host": host}, f"pid {gone.pid}"
    elif holder == "pid reused":  # a live process under the holder's pid, started later
        start = _start_time(other.pid) + 1
        record, says = {"pid": other.pid, "start_time": start, "host": host}, "another process"
    else:  # a record without a start time names a live process that is not pbt's
        record, says = {"pid": other.pid, "host": host}, "not a pbt controller"
    stale = _holding(tmp_path / "controller.lock", record)
    try:
        assert controller_running(tmp_path) is None
        said: list[str] = []
        lock = ControllerLock.acquire(tmp_path, say=said.append)
        assert len(said) == 1 and said[0].startswith("took over") and says in said[0], said
        assert controller_running(tmp_path)["pid"] == os.getpid()
        lock.close()
        assert controller_running(tmp_path) is None
    finally:
        for proc in (stale, other):
            proc.kill()
            proc.wait()


def test_a_live_controllers_lock_is_refused_naming_its_pid(tmp_path):
    script = (
        "import sys, time; from pathlib import Path; from pbt.controller.lock import "
        "ControllerLock; ControllerLock.acquire(Path(sys.argv[1])); print('held', flush=True); "
        "time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        who = f"pid {holder.pid} on {socket.gethostname()}"
        with pytest.raises(
            PbtError, match=re.escape(f"another controller is running this campaign: {who}")
        ):
            ControllerLock.acquire(tmp_path, say=pytest.fail)
        assert controller_running(tmp_path)["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    ControllerLock.acquire(tmp_path, say=pytest.fail).close()  # free once it is gone


def test_a_killed_controllers_lock_is_waited_for(tmp_path):
    """kill() returns before its target has exited and closed its files: the lock is still held
    just after, by a controller that is exiting. Taking it then waits, and succeeds."""
    script = (
        "import sys, time; from pathlib import Path; from pbt.controller.lock import "
        "ControllerLock; ControllerLock.acquire(Path(sys.argv[1])); memory = bytearray(64 << 20); "
        "print('held', flush=True); time.sleep(60)"
    )
    for _ in range(3):
        holder = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout.readline() == "held\n"
        holder.kill()
        said: list[str] = []
        ControllerLock.acquire(tmp_path, say=said.append).close()
        holder.wait()
        assert said in ([], [f"waiting for the previous controller to exit: pid {holder.pid} on "
                             f"{socket.gethostname()} was killed and is exiting"])  # fmt: skip


# -- a killed controller ---------------------------------------------------------------------

_CONTROLLER = """
import os, sys, time
from pbt.controller.campaign import Campaign
manifest, directory, forked, fake = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
campaign = Campaign.start(manifest, directory, member_command=fake)
if forked != "-" and os.fork() == 0:  # a child forked without exec, in a session of its own
    os.setsid()
    open(forked, "w").write(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
campaign.run()
campaign.close()
"""

MOMENTS = {
    "generation 0 training": ("tasks/g000-m00/heartbeat", {}),
    "between generations": ("tasks/g001-m00/task.json", {}),
    "long-lived workers training": (
        "tasks/g001-m01/heartbeat",
        {"persistent_workers": True, "slots": 2},
    ),
    "a forked child": ("tasks/g000-m01/heartbeat", {}),
}


@pytest.mark.integration
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_killed_process_group_resumes_at_once(tmp_path, straight, moment):
    """SIGKILL the controller's whole process group (its members, in sessions of their own,
    live on) and resume at once, without waiting for the killed controller to be gone: the lock
    is the resumed controller's, and the campaign the uninterrupted one."""
    marker, launch = MOMENTS[moment]
    manifest = write_manifest(
        tmp_path / "manifest.yaml", MANIFEST, budget={"generations": 4}, launch=launch
    )
    directory, forked = tmp_path / "campaign", tmp_path / "forked.pid"
    argv = [str(manifest), str(directory), str(forked) if "fork" in moment else "-", *FAKE]
    env = {**os.environ, "FAKE_MEMBER_SECONDS": "0.3"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER, *argv],
        env=env, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (directory / marker).exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"{marker} never came"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        if "fork" in moment:  # it lives on, without a copy of the lock
            child = int(forked.read_text())
            held = [os.readlink(fd) for fd in Path(f"/proc/{child}/fd").iterdir()]
            assert not [path for path in held if "controller.lock" in path], held
        _run(Campaign.resume(directory, member_command=FAKE))
    finally:
        proc.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)
    assert _campaign(directory) == _campaign(straight[1])
