"""The seam between a launcher and what runs its process groups (:mod:`pbt.launch.backend`):
the launcher goes through its backend for every start, stop and record; a backend explains
only an outcome whose group ended by itself (one the launcher stopped is the launcher's to
name); the choice of backend follows ``launch.backend``. What every launcher must do on every
backend is ``tests/integration/test_launcher_contract.py``'s."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path

import pytest
from support import FAKE

from pbt.config.sections.campaign import LaunchConfig, SlurmConfig
from pbt.launch.attempt import Outcome, TaskSpec
from pbt.launch.backend import GroupSpec, LocalBackend
from pbt.launch.build import build_backend
from pbt.launch.local import LocalLauncher
from pbt.launch.processes import ProcessGroup
from pbt.launch.slurm import SlurmBackend, _srun_signal
from pbt.protocol.messages import TASK_FILE, TaskMessage


class CountingBackend(LocalBackend):
    """This machine's backend, counting what the launcher asks of it and marking what it
    explains."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {"start": 0, "record": 0, "stop": 0, "explain": 0}

    def start(self, spec: GroupSpec):  # type: ignore[override]
        self.calls["start"] += 1
        return super().start(spec)

    def record(self, group: ProcessGroup, folder: Path) -> None:
        self.calls["record"] += 1
        super().record(group, folder)

    def stop(self, groups: list[ProcessGroup]) -> list[int]:
        self.calls["stop"] += 1
        return super().stop(groups)

    def explain(self, group: ProcessGroup, outcome: Outcome) -> Outcome:
        self.calls["explain"] += 1
        return dataclasses.replace(outcome, detail=f"explained; {outcome.detail}")


def _task(directory: Path, name: str, behaviour: str) -> TaskSpec:
    folder = directory / "tasks" / name
    folder.mkdir(parents=True)
    TaskMessage(
        campaign_dir=str(directory), manifest={}, manifest_base_dir=str(directory),
        member_id=name, generation=0, parent_id=None, parent_checkpoint=None,
        parent_digest=None, hyperparameters={"lr": 1e-3}, mutation=None, steps=1,
        checkpoint=f"checkpoints/{name}",
    ).write(folder / TASK_FILE)  # fmt: skip
    plan = directory / "faults.json"
    faults = json.loads(plan.read_text()) if plan.exists() else {}
    plan.write_text(json.dumps({**faults, name: [behaviour]}))
    return TaskSpec(name, folder, log_path=directory / "logs" / f"{name}.log")


@pytest.mark.integration
def test_the_launcher_runs_its_groups_through_its_backend(tmp_path: Path) -> None:
    """Three tasks: each started and recorded through the backend; the one that exited 1 and
    the one that succeeded are explained by it, the silent one the launcher stopped is not."""
    backend = CountingBackend()
    launcher = LocalLauncher(
        FAKE, slots=3, heartbeat_timeout_s=1.0, poll_s=0.05, campaign_dir=tmp_path,
        backend=backend,
    )  # fmt: skip
    tasks = [
        _task(tmp_path, n, b) for n, b in (("ok", "ok"), ("exits", "exit1"), ("stalls", "hang"))
    ]
    ok, exits, stalls = launcher.run(tasks)
    assert (ok.status, exits.status, stalls.status) == ("ok", "failed", "no_heartbeat")
    assert backend.calls["start"] == backend.calls["record"] == 3
    assert backend.calls["stop"] >= 3  # the stragglers of each ended group, and the silent one
    assert backend.calls["explain"] == 2
    assert exits.detail.startswith("explained; exit code 1"), exits.detail
    assert not stalls.detail.startswith("explained"), stalls.detail
    assert all((t.task_dir / "pgid").is_file() for t in tasks)  # the local backend's record


def test_srun_exit_codes_past_128_name_the_signal() -> None:
    assert _srun_signal(128 + signal.SIGKILL) == "SIGKILL"
    assert _srun_signal(128 + signal.SIGTERM) == "SIGTERM"
    assert [_srun_signal(code) for code in (None, 0, 1, 2, 128, 255)] == [None] * 6


def test_the_backend_follows_launch_backend(tmp_path: Path) -> None:
    assert type(build_backend(LaunchConfig(), tmp_path)) is LocalBackend
    slurm = build_backend(LaunchConfig(backend="slurm", slurm=SlurmConfig(poll_s=3.0)), tmp_path)
    assert isinstance(slurm, SlurmBackend) and slurm.job_name == f"pbt-{tmp_path.name}"
    assert slurm.poll_s == 1.0  # a launcher looks at least once a second; squeue every 3 s
    assert LocalLauncher(["x"], slots=1, backend=slurm).poll_s == 1.0
    assert LocalLauncher(["x"], slots=1).poll_s == LocalLauncher.default_poll_s
    with pytest.raises(ValueError, match=r"launch.backend \('ray'\) names no backend"):
        build_backend(LaunchConfig(backend="ray"), tmp_path)  # type: ignore[arg-type]


def test_a_local_group_is_never_adopted(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="never adopted"):
        LocalBackend().adopt("123", tmp_path)
    assert LocalBackend().member_command()[:3] == [sys.executable, "-m", "torch.distributed.run"]
