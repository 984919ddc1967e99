"""The private MPS daemon for members that share a GPU, against a small hand-written
``nvidia-cuda-mps-control`` (the real one needs an NVIDIA GPU): started with its own pipe and
log folders, its variables handed to the workers, asked to quit at the end; without the
command, or when it fails, the campaign is told that its members are time-sliced."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pbt.launch.mps import MpsDaemon

FAKE = """#!/bin/sh
echo "$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY stdin=$(cat -)" >> "{record}"
exit {code}
"""


def _fake_control(folder: Path, code: int = 0) -> Path:
    record = folder / "calls.txt"
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(FAKE.format(record=record, code=code))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return record


def test_a_private_daemon_is_started_and_asked_to_quit(tmp_path: Path, monkeypatch) -> None:
    record = _fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    daemon = MpsDaemon().start()
    pipe = daemon.env["CUDA_MPS_PIPE_DIRECTORY"]
    assert Path(pipe).is_dir() and len(pipe) < 80  # fits a Unix socket name with room to spare
    assert "private MPS daemon" in daemon.note
    daemon.stop()
    started, quit_ = record.read_text().splitlines()
    assert started.startswith("-d pipe=" + pipe)
    assert quit_.startswith(" pipe=" + pipe) and quit_.endswith("stdin=quit")
    assert not Path(pipe).exists() and daemon.env == {}


@pytest.mark.parametrize("how", ["missing", "failing", "given"])
def test_without_a_daemon_of_its_own_the_campaign_is_told(tmp_path: Path, monkeypatch, how) -> None:
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    if how == "missing":
        monkeypatch.setenv("PATH", str(tmp_path))
    elif how == "failing":
        _fake_control(tmp_path, code=3)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    else:
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    daemon = MpsDaemon().start()
    assert daemon.env == {}
    expected = {"missing": "not on PATH", "failing": "failed", "given": "environment names"}
    assert expected[how] in daemon.note
    daemon.stop()  # nothing to stop
