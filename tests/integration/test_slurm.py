"""The Slurm backend against a real single-node Slurm (slurmctld + slurmd on 127.0.0.1).

The cluster is the one named by ``PBT_TEST_SLURM_CONF`` (``.ci/run`` brings it up with
``tests/slurm/cluster.sh``), or else a private one the session brings up and stops itself
where it can (root and Debian's packages; :func:`support.slurm_cluster`). Elsewhere the tests
skip, saying why; with ``PBT_REQUIRE_SLURM=1`` (CI) they fail instead. An ambient
``SLURM_CONF`` is never used: the tests must not submit jobs to a real cluster. What every
launcher must do, on Slurm too, is ``test_launcher_contract.py``'s.

Launcher tests run a small hand-written member program as jobs (no torch): job states become
outcomes, a job past its time is recorded as ``timeout`` (Slurm enforces limits in minutes, so
that job is started first and checked last), pending jobs show as queued. Campaign tests run
the real member entry point on the tiny model: the same decisions as the local backend, a
member over two "nodes", ``scancel`` -> retried then replaced, a controller SIGKILLed and
resumed (its jobs adopted, none run twice), ``pbt stop`` and ``pbt submit``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support import slurm_conf

from pbt.config.sections.campaign import SlurmConfig
from pbt.controller.report import status_text
from pbt.controller.store import CampaignStore
from pbt.launch.local import LocalLauncher, TaskSpec
from pbt.launch.processes import JOB_CANCEL_WAIT_S
from pbt.launch.slurm import SlurmBackend, SlurmQueue, read_job
from pbt.protocol.files import read_json, write_json_atomic
from pbt.protocol.messages import TASK_FILE, TaskMessage
from tests.support import TINY_CAMPAIGN

pytestmark = pytest.mark.integration

PBT = [sys.executable, "-m", "pbt.cli"]


@pytest.fixture(scope="module", autouse=True)
def cluster(slurm_cluster_conf: str) -> Iterator[str]:
    """SLURM_CONF pointing at the session's test cluster for this module, restored afterwards
    (every job of the module cancelled)."""
    with slurm_conf(slurm_cluster_conf) as conf:
        yield conf


def _wait(condition, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


# -- the launcher, with a hand-written member ------------------------------------------------

FAKE_MEMBER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from pbt.protocol.files import Heartbeat, write_json_atomic
    from pbt.protocol.messages import ResultMessage, TaskMessage

    task_path = Path(sys.argv[-1])
    task, folder = TaskMessage.read(task_path), task_path.parent
    fields = json.loads((folder / "fields.json").read_text())
    how = fields.get("behaviour", "ok")
    print(f"fake member doing {how} in job {os.environ.get('SLURM_JOB_ID')}", flush=True)
    with Heartbeat(folder / "heartbeat", interval_s=0.2):
        if how == "exit3":
            sys.exit(3)
        time.sleep(float(fields.get("sleep", 0.2)))
    write_json_atomic(folder / "observed.json", {"job": os.environ["SLURM_JOB_ID"],
                                                 "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")})
    ResultMessage(status="ok", member_id=task.member_id, fitness=0.0, steps=task.steps,
                  checkpoint=task.checkpoint, digest="d", metrics={},
                  history=[]).write(folder / "result.json")
    """
)


def _launcher(tmp: Path, slots: int = 2, **slurm) -> LocalLauncher:
    program = tmp / "fake_member.py"
    program.write_text(FAKE_MEMBER)
    config = SlurmConfig(time=slurm.pop("time", "00:05:00"), poll_s=0.3, **slurm)
    return LocalLauncher(
        [sys.executable, str(program)], backend=SlurmBackend(config, name="pbt-test"),
        slots=slots, heartbeat_timeout_s=60,
    )  # fmt: skip


def _task(tmp: Path, name: str, **fields) -> TaskSpec:
    folder = tmp / "tasks" / name
    folder.mkdir(parents=True)
    TaskMessage(
        campaign_dir=str(tmp), manifest={}, manifest_base_dir=str(tmp), member_id=name,
        generation=0, parent_id=None, parent_checkpoint=None, parent_digest=None,
        hyperparameters={"lr": 1e-3}, mutation=None, steps=1, checkpoint=f"checkpoints/{name}",
    ).write(folder / TASK_FILE)  # fmt: skip
    write_json_atomic(folder / "fields.json", fields)  # how the fake member behaves
    return TaskSpec(name, folder, log_path=tmp / "logs" / f"{name}.log")


@pytest.fixture(scope="module")
def over_time(tmp_path_factory: pytest.TempPathFactory):
    """A job past its one-second limit, started before the other tests: Slurm counts limits in
    minutes and checks them every 30 s, so its end is seen a minute or two later."""
    tmp = tmp_path_factory.mktemp("over_time")
    launcher = _launcher(tmp, time="0:01")
    outcomes: list = []
    task = _task(tmp, "late", sleep=600)
    thread = threading.Thread(target=lambda: outcomes.extend(launcher.run([task])), daemon=True)
    thread.start()
    return thread, outcomes


def test_job_states_become_outcomes(tmp_path: Path, over_time) -> None:
    launcher = _launcher(tmp_path)
    tasks = [_task(tmp_path, "ok"), _task(tmp_path, "exit3", behaviour="exit3")]
    ok, failed = launcher.run(tasks)
    assert ok.status == "ok", ok.detail
    observed = read_json(tmp_path / "tasks" / "ok" / "observed.json")
    assert observed["cuda"] == "", "a CPU member's job hides the GPUs"
    assert read_job(tmp_path / "tasks" / "ok")["state"] == "COMPLETED"
    assert observed["job"] == read_job(tmp_path / "tasks" / "ok")["job_id"]
    assert failed.status == "failed" and failed.returncode == 3, failed.detail
    assert "exit code 3" in failed.detail
    script = (tmp_path / "logs" / "ok.sbatch").read_text()
    assert "#SBATCH --time=00:05:00" in script and "srun --kill-on-bad-exit=1" in script
    assert "fake member doing ok" in (tmp_path / "logs" / "ok.log").read_text()


def test_scancel_mid_task_is_recorded_as_cancelled(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path)
    task = _task(tmp_path, "victim", sleep=120)
    outcomes: list = []
    thread = threading.Thread(target=lambda: outcomes.extend(launcher.run([task])))
    thread.start()
    beat = tmp_path / "tasks" / "victim" / "heartbeat"
    _wait(beat.exists, 60, "the member's first heartbeat")
    subprocess.run(["scancel", read_job(task.task_dir)["job_id"]], check=True)
    thread.join(120)
    (outcome,) = outcomes
    assert outcome.status == "cancelled", outcome.detail
    assert "ended CANCELLED" in outcome.detail


def test_jobs_past_the_slots_queue_and_status_says_so(tmp_path: Path) -> None:
    """Each job asks for 5 of the test node's 8 CPUs: the second waits PENDING (Resources)."""
    launcher = _launcher(tmp_path, slots=2, cpus_per_task=5)
    tasks = [_task(tmp_path, f"q{i}", sleep=4) for i in range(2)]
    outcomes: list = []
    thread = threading.Thread(target=lambda: outcomes.extend(launcher.run(tasks)))
    thread.start()
    states = _wait(
        lambda: (
            (
                {read_job(t.task_dir)["state"] for t in tasks if read_job(t.task_dir)}
                >= {"RUNNING", "PENDING"}
            )
            and [read_job(t.task_dir) for t in tasks]
        ),
        60,
        "one job running and one pending",
        poll=0.1,
    )
    pending = next(s for s in states if s["state"] == "PENDING")
    assert pending["reason"] in ("Resources", "Priority"), pending
    thread.join(120)
    assert [o.status for o in outcomes] == ["ok", "ok"]
    first, second = (read_json(t.task_dir / "observed.json") for t in tasks)
    assert first["job"] != second["job"]


# -- campaigns on the tiny model --------------------------------------------------------------

MANIFEST = {
    **TINY_CAMPAIGN,
    "population": {**TINY_CAMPAIGN["population"], "size": 2, "evo_steps": 2},
    "budget": {"generations": 2},
}
SLURM = {"backend": "slurm", "slurm": {"time": "00:10:00", "poll_s": 0.3}}


def _manifest(folder: Path, name: str, **launch) -> Path:
    body = {**MANIFEST, "launch": {**MANIFEST["launch"], **launch}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _decisions(directory: Path) -> list[tuple]:
    with CampaignStore(directory / "store.db") as store:
        return [
            (m.member_id, m.parent_id, m.hyperparameters, m.mutation, m.fitness_history, m.status)
            for m in store.members()
        ]


def _pbt(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([*PBT, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"pbt {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    folder = tmp_path_factory.mktemp("local")
    _pbt("run", str(_manifest(folder, "local")), "--dir", str(folder / "c"))
    return _decisions(folder / "c")


def test_a_slurm_campaign_decides_as_the_local_one(tmp_path: Path, local_reference) -> None:
    _pbt("run", str(_manifest(tmp_path, "slurm", **SLURM)), "--dir", str(tmp_path / "c"))
    assert _decisions(tmp_path / "c") == local_reference
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        launches = store.launches()
    assert len(launches) == 4 and {r["backend"] for r in launches} == {"slurm"}
    for row in launches:
        job = read_job(tmp_path / "c" / "tasks" / row["member_id"])
        assert job["job_id"] == row["launch_id"] and job["state"] == "COMPLETED"


def test_long_lived_worker_jobs_decide_as_the_local_one(tmp_path: Path, local_reference) -> None:
    """``launch.persistent_workers`` on Slurm: one long-running job per slot takes member after
    member from its inbox; the campaign's end cancels nothing left running."""
    manifest = _manifest(tmp_path, "workers", **SLURM, persistent_workers=True)
    _pbt("run", str(manifest), "--dir", str(tmp_path / "c"))
    assert _decisions(tmp_path / "c") == local_reference
    jobs = [read_job(p) for p in sorted((tmp_path / "c" / "workers").glob("slot*"))]
    assert len(jobs) == 2 and all(j is not None for j in jobs)
    queue = SlurmQueue(poll_s=0)
    assert all(queue.state(j["job_id"]).ended for j in jobs)
    served = sorted((tmp_path / "c" / "workers").glob("slot*/inbox/*.json"))
    assert len(served) == 4


def test_a_member_spans_two_nodes(tmp_path: Path) -> None:
    """Two Slurm tasks on this host, each a torchrun agent with one rank: world size 2."""
    slurm = {"time": "00:10:00", "poll_s": 0.3, "tasks_per_node": 2}
    manifest = _manifest(tmp_path, "two", backend="slurm", slurm=slurm, nproc_per_member=2, slots=1)
    body = yaml.safe_load(manifest.read_text())
    body["population"] |= {"size": 1, "tournament_size": 1}
    body["budget"] = {"generations": 1}
    manifest.write_text(yaml.safe_dump(body))
    _pbt("run", str(manifest), "--dir", str(tmp_path / "c"))
    log = (tmp_path / "c" / "logs" / "g000-m00.attempt1.log").read_text()
    assert "2 torchrun agent(s) x 1 rank(s)" in log
    inspect = _pbt("inspect", str(tmp_path / "c" / "checkpoints" / "g000-m00")).stdout
    assert "saved at world size 2" in inspect


def _job_running(directory: Path, member: str) -> dict | None:
    job = read_job(directory / "tasks" / member)
    if job is None or SlurmQueue(poll_s=0).state(job["job_id"]).state != "RUNNING":
        return None
    beat = directory / "tasks" / member / "heartbeat"
    return job if beat.exists() else None


def test_a_cancelled_member_is_retried_then_replaced(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path, "cancel", **SLURM)
    directory = tmp_path / "c"
    proc = subprocess.Popen([*PBT, "run", str(manifest), "--dir", str(directory)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        seen = set()
        for _ in range(2):  # both attempts of g001-m01
            job = _wait(
                lambda: (
                    (j := _job_running(directory, "g001-m01")) and j["job_id"] not in seen and j
                ),
                300,
                "a running job of g001-m01",
            )
            seen.add(job["job_id"])
            subprocess.run(["scancel", job["job_id"]], check=True)
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    with CampaignStore(directory / "store.db") as store:
        faults = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        replaced = store.member("g001-m01")
    assert faults == [
        ("g001-m01", 1, "cancelled"),
        ("g001-m01", 2, "cancelled"),
        ("g001-m01", 2, "replaced"),
    ]
    assert replaced.status == "done" and "replac" in out


def test_a_killed_controller_resumes_and_adopts_its_jobs(tmp_path: Path, local_reference) -> None:
    manifest = _manifest(tmp_path, "resume", **SLURM)
    directory = tmp_path / "c"
    proc = subprocess.Popen([*PBT, "run", str(manifest), "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    job = _wait(lambda: _job_running(directory, "g001-m00"), 300, "generation 1 running")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert SlurmQueue(poll_s=0).state(job["job_id"]).state in ("RUNNING", "COMPLETING", "COMPLETED")
    out = _pbt("resume", str(directory)).stdout
    assert f"adopting job {job['job_id']}" in out
    assert _decisions(directory) == local_reference
    with CampaignStore(directory / "store.db") as store:
        launches = store.launches()
    per_attempt = [(r["member_id"], r["attempt"]) for r in launches]
    assert len(per_attempt) == len(set(per_attempt)) == 4, launches  # none submitted twice


def test_pbt_stop_interrupts_the_controller_and_cancels_its_jobs(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path, "stop", **SLURM)
    body = yaml.safe_load(manifest.read_text())  # long enough that it cannot end before the stop
    manifest.write_text(yaml.safe_dump({**body, "budget": {"generations": 50}}))
    directory = tmp_path / "c"
    # started as a script's background job is: with SIGINT ignored, which the controller undoes
    proc = subprocess.Popen([*PBT, "run", str(manifest), "--dir", str(directory)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # fmt: skip
    job = _wait(lambda: _job_running(directory, "g000-m00"), 300, "generation 0 running")
    status = _pbt("status", str(directory)).stdout
    assert f"job {job['job_id']} RUNNING" in status and "attempt1.log" in status
    said = _pbt("stop", str(directory)).stdout
    assert "interrupted the controller" in said and "pbt resume" in said
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    # the job running at the stop (g000-m00's, or a later one's on a slow machine) is
    # cancelled, and none of the campaign's is left running or queued
    jobs = [j for d in sorted((directory / "tasks").iterdir()) if (j := read_job(d))]
    states = [SlurmQueue(poll_s=0).state(j["job_id"]).state for j in jobs]
    assert "CANCELLED" in states and not {"RUNNING", "PENDING"} & set(states), states


def test_pbt_submit_runs_the_controller_as_a_job(tmp_path: Path, local_reference) -> None:
    manifest = _manifest(tmp_path, "submit", **SLURM)
    directory = tmp_path / "c"
    out = _pbt("submit", str(manifest), "--dir", str(directory)).stdout
    job = out.split("Slurm job ")[1].split()[0]
    queue = SlurmQueue(poll_s=0)
    state = _wait(lambda: (s := queue.state(job)).ended and s, 600, "the controller job", poll=1)
    log = (directory / "controller.log").read_text()
    assert state.state == "COMPLETED", log
    assert "stopped: 2 generations done" in log
    assert _decisions(directory) == local_reference


def test_a_job_past_its_time_is_recorded_as_timeout(over_time) -> None:
    thread, outcomes = over_time
    thread.join(240)
    assert not thread.is_alive(), "Slurm did not end the job past its time limit"
    (outcome,) = outcomes
    assert outcome.status == "timeout", outcome.detail
    assert "time limit" in outcome.detail


def test_status_shows_a_queued_member(tmp_path: Path) -> None:
    """``pbt status`` of a campaign whose member waits: ``queued`` with the job and reason."""
    manifest = _manifest(tmp_path, "queued", backend="slurm",
                         slurm={"time": "00:10:00", "poll_s": 0.3, "cpus_per_task": 4})  # fmt: skip
    directory = tmp_path / "c"
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--cpus-per-task=5", f"--output={tmp_path / 'blocker.out'}",
         "--wrap", "sleep 120"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    proc = subprocess.Popen([*PBT, "run", str(manifest), "--dir", str(directory)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        _wait(
            lambda: (j := read_job(directory / "tasks" / "g000-m00")) and j["reason"],
            120,
            "the member queued behind the blocker",
        )
        status = status_text(directory)
        assert "queued" in status and re.search(r"PENDING \((Resources|Priority)\)", status), status
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(JOB_CANCEL_WAIT_S + 60)  # it waits that long at most for its cancelled jobs
        subprocess.run(["scancel", blocker], check=False)
