"""A campaign whose members sample on dedicated rollout engines, on the CPU: an AgileRL Arena
manifest with ``rollout_engines_per_agent: auto`` and ``max_rollout_version_lag`` passes
``pbt check`` (which names the placement) and runs 2 members x 1 generation; each engine is a
process of its own, on the device it was assigned, and ``pbt status`` shows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support import FIXTURES

from pbt.cli.main import main as pbt_main
from pbt.protocol.engines import read_statuses

FIXTURE = FIXTURES / "agilerl" / "grpo_arena_auto.yaml"
PBT = [sys.executable, "-m", "pbt.cli"]


@pytest.mark.integration
def test_an_arena_auto_manifest_runs_on_engine_processes_that_pbt_status_shows(
    tmp_path, capsys
) -> None:
    assert pbt_main(["check", str(FIXTURE)]) == 0
    err = capsys.readouterr().err
    assert "note: rollout engines: 1 a member, each its own process on the CPU" in err
    directory = tmp_path / "campaign"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [*PBT, "run", str(FIXTURE), "--dir", str(directory)], capture_output=True, text=True,
        env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "rollout engines: 1 a member, each its own process on the CPU" in run.stdout
    logs = "".join(p.read_text() for p in (directory / "logs").glob("*.log"))
    assert " behind" in logs  # the members learned from samples drawn on their engines

    tasks = sorted((directory / "tasks").iterdir())
    assert len(tasks) == 2
    for task in tasks:
        (engine,) = read_statuses(task)
        assert (engine.device, engine.placement, engine.state) == ("cpu", "cpu", "drained")
        assert engine.pid is not None and engine.heartbeat is not None
        assert engine.pid != engine.trainer_pid  # a process of its own
        assert engine.restarts == 0 and engine.stale_dropped >= 0

    assert pbt_main(["status", str(directory)]) == 0
    text = capsys.readouterr().out.split("rollout engines:", 1)[1]
    lines = re.findall(
        r"(\S+) engine 0: pid (\d+) on cpu \(cpu\), drained, adapter v(\d+), "
        r"heartbeat \d+ s ago, restarts 0, stale_dropped (\d+)",
        text,
    )
    assert sorted(m for m, *_ in lines) == sorted(t.name for t in tasks)
