"""Live progress: the heartbeat's payload."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pbt.protocol.files import Heartbeat
from pbt.protocol.progress import Progress, ProgressReport, read_progress


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the heartbeat's payload -------------------------------------------------------------------


def test_progress_round_trips_through_the_heartbeat(tmp_path: Path):
    clock = Clock()
    path = tmp_path / "heartbeat"
    with Heartbeat(path, interval_s=0.05) as beat:
        report = ProgressReport(beat, steps=4, clock=clock)
        assert read_progress(path).phase == "loading"
        report.phase("training")
        clock.now += 2.0
        report.stepped({"reward_mean": 0.25, "tokens_per_s": 500.0, "loss": 0.1})
        clock.now += 4.0
        report.stepped({"reward_mean": 0.5, "tokens_per_s": 700.0})
        time.sleep(0.15)  # beats in between touch the file and keep what it says
        seen = read_progress(path)
        report.phase("evaluating")
    assert (seen.phase, seen.step, seen.steps) == ("training", 2, 4)
    assert (seen.reward, seen.tokens_per_s) == (0.5, 700.0)
    assert seen.eta_s == pytest.approx(6.0)  # 3 s a step so far, 2 steps left
    assert 0 < time.time() - seen.time < 5
    assert read_progress(path).phase == "evaluating"
    assert json.loads(path.read_text())["phase"] == "evaluating"  # plain JSON, for any reader


def test_a_missing_empty_or_partial_payload_reads_as_unknown(tmp_path: Path):
    path = tmp_path / "heartbeat"
    assert read_progress(path) is None  # no file
    with Heartbeat(path):  # an old-style member: touches, writes nothing
        pass
    assert path.read_text() == "" and read_progress(path) is None
    path.write_text('{"phase": "training", "step": 3, "st')  # cut off mid-write
    assert read_progress(path) is None
    path.write_text('{"phase": "sleeping"}')
    assert read_progress(path) is None
    path.write_text('{"phase": "training", "step": "3", "reward": NaN, "eta_s": true}')
    progress = read_progress(path)
    assert progress == Progress("training")  # wrong types and NaN are unknown, not errors


def test_a_report_without_a_heartbeat_writes_nothing(tmp_path: Path):
    report = ProgressReport(None, steps=2)
    report.stepped({"reward_mean": 1.0})
    assert report.progress.step == 1 and report.progress.time is None
    with pytest.raises(ValueError, match=r"phase \('napping'\) must be one of loading"):
        report.phase("napping")


def test_the_eta_counts_down_from_the_time_it_was_written():
    progress = Progress("training", 2, 10, eta_s=30.0, time=1000.0)
    assert progress.eta_now(1010.0) == 20.0 and progress.eta_now(1100.0) == 0.0
    assert Progress("saving", 10, 10, eta_s=30.0).eta_now() == 0.0
    assert Progress("loading", steps=10).eta_now() is None
