"""Resume after a crash and after the end: the controller lock never outlives its controller, a
controller's process group killed at any moment resumes at once to the same campaign, a
finished campaign says so, and a budget raised by resume gives the longer campaign."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import FAKE, FAKE_CAMPAIGN, TESTS, campaign_processes, start_campaign, write_manifest

from pbt.cli.main import main, pbt_command
from pbt.config.errors import ConfigError, PbtError
from pbt.config.read.loader import manifest_from_dict
from pbt.controller.budget import with_budget
from pbt.controller.campaign import Campaign
from pbt.controller.lock import ControllerLock, controller_running
from pbt.controller.store import CampaignStore
from pbt.launch.local import member_command

FIXTURES = TESTS / "fixtures" / "agilerl"
MANIFEST = {
    **FAKE_CAMPAIGN,
    "launch": {**FAKE_CAMPAIGN["launch"], "slots": 4},
}  # a generation at once


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


@pytest.mark.integration
def test_an_attempt_the_controllers_death_cut_short_costs_no_retry(tmp_path, straight):
    """A member killed with its controller runs again as the same attempt: when that run
    fails (here on purpose; under load, a slow start past the heartbeat timeout), the member
    still has its retry, and the campaign is the uninterrupted one, not one where the member
    was replaced by a clone of the best after its "last" attempt."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST, budget={"generations": 4})
    directory = tmp_path / "campaign"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER, str(manifest), str(directory), "-", *FAKE],
        env={**os.environ, "FAKE_MEMBER_SECONDS": "30"}, stdout=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (directory / "tasks/g000-m01/heartbeat").exists():  # its first run started
            assert proc.poll() is None and time.monotonic() < deadline, "g000-m01 never started"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    # the member's own second run (the first after the resume) fails, its third succeeds
    (directory / "faults.json").write_text(json.dumps({"g000-m01": ["ok", "exit1"]}))
    _run(Campaign.resume(directory, member_command=FAKE))
    assert _campaign(directory) == _campaign(straight[1])
    with CampaignStore(directory / "store.db") as store:
        retried = next(m for m in store.members(0) if m.member_id == "g000-m01")
        faults = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults(0)]
    assert retried.attempts == 2 and faults == [("g000-m01", 1, "failed")], faults


TORCHRUN_FAKE = [*member_command()[:-2], FAKE[1]]
"""The default member command (torchrun: an agent and its rank, each in a session of its own)
with the fake member in place of ``-m pbt.worker``."""


@pytest.mark.integration
@pytest.mark.parametrize("point", ["store:3", "commit:2"])
def test_a_kill_at_the_final_commit_leaves_no_process_after_the_resume(tmp_path, point):
    """The controller of a two-generation campaign on long-lived workers is killed inside the
    final generation's commit (``store:3``: generation 0's creation and commit came first) or
    right after it (``commit:2``); its workers (torchrun agents and their ranks) live on.
    ``pbt resume`` finishes the campaign, and a census then finds no process of it."""
    launch = {"persistent_workers": True, "slots": 2, "heartbeat_timeout_s": 60}
    manifest = write_manifest(
        tmp_path / "manifest.yaml", MANIFEST, budget={"generations": 2}, launch=launch
    )
    directory = tmp_path / "campaign"
    proc = start_campaign(
        manifest, directory, TORCHRUN_FAKE, 0.05, {"PBT_CRASH_AT": point},
        stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.wait(timeout=180) == -signal.SIGKILL
        assert len(campaign_processes(directory)) >= 2  # the killed controller's workers
        assert main(["resume", str(directory)]) == 0
        assert campaign_processes(directory) == []
        with CampaignStore(directory / "store.db") as store:
            assert store.last_committed_generation() == 1 and store.faults() == []
    finally:
        for line in campaign_processes(directory):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


# -- a finished campaign, and a budget raised by resume ------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-generation campaign run to its end (copy it before changing it)."""
    root = tmp_path_factory.mktemp("finished")
    manifest = write_manifest(root / "manifest.yaml", MANIFEST, budget={"generations": 2})
    _run(Campaign.start(manifest, root / "campaign", member_command=FAKE))
    return root / "campaign"


@pytest.mark.integration
def test_resuming_a_finished_campaign_says_so(tmp_path, finished, capsys):
    directory = shutil.copytree(finished, tmp_path / "c")
    assert main(["resume", str(directory)]) == 0
    out = capsys.readouterr().out
    assert (
        f"campaign {directory} finished: 2 generations done; to train further: "
        f"{pbt_command()} resume {directory} --generations N (N > 2)"
    ) in out
    assert "training 0 of 0" not in out
    assert controller_running(directory) is None
    summary = _run(Campaign.resume(directory, member_command=FAKE))
    assert summary.stop_reason == "2 generations done" and summary.generations == 2


@pytest.mark.integration
@pytest.mark.parametrize(
    ("first", "raised"),
    [
        ({"generations": 2}, {"generations": 4}),
        ({"generations": 50, "total_steps": 12}, {"total_steps": 48}),
        ({"generations": 3, "crash": "task:6"}, {"generations": 4}),  # interrupted in generation 1
    ],
)
def test_a_budget_raised_by_resume_gives_the_longer_campaign(tmp_path, straight, first, raised):
    """Each member trains 3 steps and a generation has 4: 48 steps are 4 generations."""
    first = dict(first)
    crash = first.pop("crash", None)
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST, budget=first)
    directory = tmp_path / "campaign"
    if crash is None:
        _run(Campaign.start(manifest, directory, member_command=FAKE))
    else:
        proc = start_campaign(manifest, directory, FAKE, 0.05, {"PBT_CRASH_AT": crash})
        assert proc.wait(timeout=60) == -signal.SIGKILL
    summary = _run(Campaign.resume(directory, member_command=FAKE, budget=raised))
    assert summary.generations == 4
    assert _campaign(directory) == _campaign(straight[1])
    with CampaignStore(directory / "store.db") as store:  # a plain resume keeps the budget
        assert store.load_config()["manifest"]["budget"] == first | raised
    again = Campaign.resume(directory, member_command=FAKE)
    (key,) = raised
    assert again.ended() == (key, summary.stop_reason)
    again.close()


@pytest.mark.integration
def test_run_takes_the_budget_flags_resume_takes(tmp_path, straight, capsys):
    """``pbt run --generations 4`` over a manifest that says 2 runs the campaign the manifest
    with 4 would (the store keeps the flag's budget, as after a resume); a flag that breaks a
    rule is one line naming the flag, the key and the rule, and creates nothing."""
    manifest = write_manifest(tmp_path / "manifest.yaml", MANIFEST, budget={"generations": 2})
    directory = tmp_path / "campaign"
    summary = _run(
        Campaign.start(manifest, directory, member_command=FAKE, budget={"generations": 4})
    )
    assert summary.generations == 4 and summary.stop_reason == "4 generations done"
    assert _campaign(directory) == _campaign(straight[1])
    with CampaignStore(directory / "store.db") as store:
        assert store.load_config()["manifest"]["budget"] == {"generations": 4}

    refused = tmp_path / "refused"
    assert main(["run", str(manifest), "--dir", str(refused), "--generations", "0"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: pbt run --generations 0: 1 problem",
        "  - budget.generations (0) must be > 0",
    ]
    assert not refused.exists()
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    usage = capsys.readouterr().out
    for flag in ("--generations N", "--total-steps N", "--wall-time-s X", "--gpu-hours X"):
        assert flag in usage


@pytest.mark.integration
def test_a_budget_already_spent_or_a_decaying_schedule_is_refused(tmp_path, finished, capsys):
    directory = shutil.copytree(finished, tmp_path / "c")
    with pytest.raises(ConfigError) as err:
        Campaign.resume(directory, member_command=FAKE, budget={"total_steps": 24})
    assert err.value.problems == [
        "budget.generations (2) must be more than the 2 generations already done; give "
        "--generations 3 or more",
        "budget.total_steps (24) must be more than the campaign has used (24 steps trained); "
        "give --total-steps above it",
    ]
    assert main(["resume", str(directory), "--generations", "2"]) == 2
    err = capsys.readouterr().err
    assert "budget.generations (2) must be more than" in err and "Traceback" not in err
    with CampaignStore(directory / "store.db") as store:  # nothing was recorded
        assert store.load_config()["manifest"]["budget"] == {"generations": 2}
    assert controller_running(directory) is None

    cosine = write_manifest(tmp_path / "cosine.yaml", MANIFEST, optim={"schedule": "cosine"})
    Campaign.start(cosine, tmp_path / "cosine", member_command=FAKE).close()  # generation 0 drawn
    with pytest.raises(ConfigError, match=r"optim\.schedule is 'cosine', which decays"):
        Campaign.resume(tmp_path / "cosine", member_command=FAKE, budget={"generations": 8})
    Campaign.resume(tmp_path / "cosine", member_command=FAKE, budget={"total_steps": 99}).close()


def test_a_budget_set_by_resume_replaces_agilerls_spelling_of_it():
    sections = yaml.safe_load((FIXTURES / "grpo_rubric.yaml").read_text())
    assert sections["training"]["max_steps"] == 100000
    changed = with_budget(sections, {"total_steps": 200000})
    assert "max_steps" not in changed["training"] and sections["training"]["max_steps"] == 100000
    assert manifest_from_dict(changed, base_dir=FIXTURES).budget.total_steps == 200000
