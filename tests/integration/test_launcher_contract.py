"""What every launcher must do, asserted once and run over every kind ``build_launcher`` returns.

The kinds: a process group per task or long-lived workers (``launch.persistent_workers``), each
on this machine or as Slurm jobs (``launch.backend``; the Slurm kinds skip, saying why, where no
Slurm test cluster can be had, and fail instead under ``PBT_REQUIRE_SLURM=1``). The member is the
campaign tests' fake member (``tests/drivers/fake_member.py``), told through ``faults.json`` how
each task ends: with its result, exiting 1, with a reported fault (``diverged``), silent (no
heartbeat), heartbeating past the task's timeout, or SIGKILLed from outside. Each task that waits
starts a child that names its folder, so the census of the campaign's processes
(:func:`support.campaign_processes`) sees whatever a launcher would leave behind.

A test that fails when ``build_launcher`` can return a kind this suite does not run keeps the
list complete.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
import threading
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import FAKE, campaign_processes, slurm_conf, wait_for_no_processes

from pbt.config.sections.campaign import LaunchConfig, SlurmConfig
from pbt.launch.attempt import Outcome, TaskSpec
from pbt.launch.build import build_launcher
from pbt.launch.handahead import HandAhead
from pbt.launch.local import LocalLauncher
from pbt.protocol.messages import TASK_FILE, TaskMessage

KINDS: dict[str, dict[str, object]] = {
    "per-task": {"backend": "local", "persistent_workers": False},
    "workers": {"backend": "local", "persistent_workers": True},
    "slurm-per-task": {"backend": "slurm", "persistent_workers": False},
    "slurm-workers": {"backend": "slurm", "persistent_workers": True},
}
"""The launch settings of each kind of launcher the suite runs."""
HEARTBEAT_TIMEOUT_S = 4.0
TASK_TIMEOUT_S = 8.0
NO_ORPHANS_WITHIN_S = 10.0
contract = pytest.mark.integration
"""The contract's tests start processes (and Slurm jobs); the check of the list of kinds is
instant and runs in the fast tier."""
LR = 1e-3
FITNESS = 1.0 - abs(math.log10(LR) - math.log10(3e-3))
"""What the fake member reports for a first-generation task at ``LR``."""


def _config(kind: str, slots: int) -> LaunchConfig:
    return LaunchConfig(
        **KINDS[kind],  # type: ignore[arg-type]
        slots=slots,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        task_timeout_s=TASK_TIMEOUT_S,
        slurm=SlurmConfig(time="00:05:00", poll_s=0.3),
    )


@dataclasses.dataclass
class Rig:
    """A campaign folder where one kind of launcher runs fake members."""

    kind: str
    directory: Path

    def launcher(self, slots: int) -> LocalLauncher:
        config = _config(self.kind, slots)
        return build_launcher(config, self.directory, FAKE, {}, HandAhead())

    def task(self, name: str, *behaviours: str) -> TaskSpec:
        """Task ``name``, whose attempts behave as ``behaviours`` say (then ``ok``)."""
        folder = self.directory / "tasks" / name
        folder.mkdir(parents=True)
        TaskMessage(
            campaign_dir=str(self.directory), manifest={}, manifest_base_dir=str(self.directory),
            member_id=name, generation=0, parent_id=None, parent_checkpoint=None,
            parent_digest=None, hyperparameters={"lr": LR}, mutation=None, steps=1,
            checkpoint=f"checkpoints/{name}",
        ).write(folder / TASK_FILE)  # fmt: skip
        plan = self.directory / "faults.json"
        faults = json.loads(plan.read_text()) if plan.exists() else {}
        plan.write_text(json.dumps({**faults, name: list(behaviours)}))
        return TaskSpec(name, folder, log_path=self.directory / "logs" / f"{name}.log")

    def member_pid(self, name: str) -> int:
        """The process that ran task ``name``'s latest attempt (a long-lived worker's own)."""
        return int((self.directory / "tasks" / name / "member.pid").read_text())

    def kill_group_of(self, name: str) -> None:
        """SIGKILL the process group that runs task ``name``, once it heartbeats."""
        _wait(lambda: (self.directory / "tasks" / name / "heartbeat").exists(), 60, name)
        pid = self.member_pid(name)
        if os.getpgid(pid) == pid:  # it leads its group (locally it always does)
            os.killpg(pid, signal.SIGKILL)
        else:  # a job's task in the group of Slurm's step daemon: that one only
            os.kill(pid, signal.SIGKILL)


def _wait(condition: Callable[[], object], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _kind_param(kind: str) -> object:
    """A kind as the rig's parameter: the Slurm kinds join the Slurm tests' pytest-xdist group
    (one worker uses the session's cluster; see the repository's conftest.py)."""
    slurm = KINDS[kind]["backend"] == "slurm"
    return pytest.param(kind, marks=[pytest.mark.xdist_group("slurm")] if slurm else [])


@pytest.fixture(scope="module", params=[_kind_param(kind) for kind in KINDS])
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """A rig for each kind; the Slurm kinds on the session's test cluster."""
    kind = request.param
    directory = tmp_path_factory.mktemp(kind)
    if KINDS[kind]["backend"] != "slurm":
        yield Rig(kind, directory)
        return
    with slurm_conf(request.getfixturevalue("slurm_cluster_conf")):
        yield Rig(kind, directory)


@pytest.fixture(scope="module")
def every_end(rig: Rig) -> tuple[dict[str, Outcome], list[str]]:
    """One run of tasks that end in every way, at once: their outcomes by task, and the
    campaign's processes left once the run has returned and the launcher is closed."""
    tasks = [
        rig.task("succeeds"),
        rig.task("exits", "exit1"),
        rig.task("diverges", "diverged"),
        rig.task("stalls", "hang"),
        rig.task("overruns", "hang_beating"),
        rig.task("killed", "hang_beating"),
    ]
    launcher = rig.launcher(slots=len(tasks))
    killer = threading.Thread(target=rig.kill_group_of, args=("killed",), daemon=True)
    killer.start()
    try:
        outcomes = launcher.run(tasks)
    finally:
        launcher.close()
    killer.join(1)
    left = wait_for_no_processes(rig.directory, NO_ORPHANS_WITHIN_S)
    return {o.task_id: o for o in outcomes}, left


@contract
def test_a_task_that_succeeds_gives_the_members_result(every_end) -> None:
    outcome = every_end[0]["succeeds"]
    assert (outcome.status, outcome.returncode) == ("ok", 0), outcome.detail
    assert outcome.result is not None and outcome.result.member_id == "succeeds"
    assert outcome.result.checkpoint == "checkpoints/succeeds"
    assert outcome.result.fitness == pytest.approx(FITNESS)


@contract
def test_a_member_that_exits_non_zero_fails_with_the_tail_of_its_log(every_end) -> None:
    outcome = every_end[0]["exits"]
    assert outcome.status == "failed" and outcome.result is None, outcome.detail
    assert outcome.returncode != 0 and "exit code 1" in outcome.detail
    assert "--- last lines of" in outcome.detail
    assert "error: exits fails on attempt 1" in outcome.detail


@contract
def test_a_fault_the_member_reports_is_the_outcomes_class(every_end) -> None:
    outcome = every_end[0]["diverges"]
    assert outcome.status == "diverged", outcome.detail
    assert "training diverged at step 1" in outcome.detail


@contract
def test_a_member_that_stalls_is_stopped_for_its_silent_heartbeat(every_end) -> None:
    outcome = every_end[0]["stalls"]
    assert outcome.status == "no_heartbeat", outcome.detail
    assert "no heartbeat" in outcome.detail
    assert HEARTBEAT_TIMEOUT_S <= outcome.seconds < TASK_TIMEOUT_S


@contract
def test_a_member_past_its_time_is_stopped_as_timeout(every_end) -> None:
    outcome = every_end[0]["overruns"]
    assert outcome.status == "timeout", outcome.detail
    assert "task_timeout_s" in outcome.detail and outcome.seconds >= TASK_TIMEOUT_S


@contract
def test_a_group_killed_from_outside_is_reported_not_waited_for(every_end) -> None:
    outcome = every_end[0]["killed"]
    assert outcome.status == "failed" and outcome.returncode != 0, outcome.detail
    assert "killed by SIGKILL" in outcome.detail
    assert outcome.seconds < TASK_TIMEOUT_S, "the launcher waited for the task's timeout"


@contract
def test_no_process_of_a_stopped_or_killed_group_is_left(every_end) -> None:
    assert every_end[1] == []


@contract
def test_a_task_after_a_failure_runs_on_a_fresh_process(rig: Rig) -> None:
    """One slot: the task after a failed one runs there, in a new process (a long-lived
    worker taken down by the failure is replaced; the task it was handed ahead goes to the
    new one, so it may be started twice but runs once)."""
    first, second = rig.task("fails-first", "exit1"), rig.task("runs-after")
    slots: list[int] = []
    launcher = rig.launcher(slots=1)
    try:
        outcomes = launcher.run([first, second], on_start=lambda _, slot: slots.append(slot))
    finally:
        launcher.close()
    assert [o.status for o in outcomes] == ["failed", "ok"], [o.detail for o in outcomes]
    assert set(slots) == {0}
    assert rig.member_pid("runs-after") != rig.member_pid("fails-first")
    assert wait_for_no_processes(rig.directory, NO_ORPHANS_WITHIN_S) == []


@contract
def test_an_interrupted_run_ends_every_process_it_started(rig: Rig) -> None:
    """An exception in the caller's hook (Ctrl-C) stops every group the run started, members
    and their children, before it propagates."""
    tasks = [rig.task(f"interrupted{i}", "hang_beating") for i in range(2)]
    running: list[str] = []

    def interrupt_once_both_run(*_: object) -> None:
        census = campaign_processes(rig.directory)
        if sum("time.sleep(600)" in process for process in census) == len(tasks):  # children
            running.extend(census)
            raise KeyboardInterrupt

    launcher = rig.launcher(slots=2)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run(tasks, on_poll=interrupt_once_both_run)
    finally:
        launcher.close()
    assert len(running) >= 4, running  # two members, each with its child
    assert wait_for_no_processes(rig.directory, NO_ORPHANS_WITHIN_S) == []


# -- the list of kinds is complete -----------------------------------------------------------


def _switches() -> list[dict[str, object]]:
    """Every combination of the launch section's choices (its booleans and its literals)."""
    hints = typing.get_type_hints(LaunchConfig)
    choices: dict[str, tuple] = {}
    for field in dataclasses.fields(LaunchConfig):
        hint = hints[field.name]
        if hint is bool:
            choices[field.name] = (False, True)
        elif typing.get_origin(hint) is typing.Literal:
            choices[field.name] = typing.get_args(hint)
    return [
        dict(zip(choices, values, strict=True)) for values in itertools.product(*choices.values())
    ]


def _shape(launch: LaunchConfig, directory: Path) -> tuple[str, str]:
    """The launcher class and backend class ``build_launcher`` returns for ``launch``."""
    launcher = build_launcher(launch, directory, FAKE, {}, HandAhead())
    return type(launcher).__name__, type(launcher.backend).__name__


def test_the_suite_runs_every_kind_of_launcher_build_launcher_returns(tmp_path: Path) -> None:
    switches = _switches()
    assert {"backend", "persistent_workers"} <= set(switches[0])
    built = {_shape(LaunchConfig(**choice), tmp_path) for choice in switches}  # type: ignore[arg-type]
    run = {_shape(_config(kind, 1), tmp_path) for kind in KINDS}
    assert len(run) == len(KINDS), f"two kinds of the suite build the same launcher: {run}"
    assert built <= run, f"launchers the contract suite does not run: {sorted(built - run)}"
