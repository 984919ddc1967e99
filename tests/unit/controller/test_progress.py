"""Live progress: the heartbeat's payload, the controller's display (plain lines and tqdm bars),
``pbt status`` on a running member, and the lines a real campaign prints without a terminal."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support import write_manifest

from pbt.controller.campaign import Campaign
from pbt.controller.progress import (
    Plan,
    ProgressDisplay,
    describe,
    format_duration,
)
from pbt.controller.report import status_text
from pbt.launch.local import TaskSpec
from pbt.protocol.files import Heartbeat
from pbt.protocol.progress import Progress, ProgressReport, read_progress


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _task(root: Path, member: str, progress: Progress | None = None) -> TaskSpec:
    task_dir = root / "tasks" / member
    task_dir.mkdir(parents=True, exist_ok=True)
    if progress is not None:
        Heartbeat(task_dir / "heartbeat").report(progress.to_json())
    return TaskSpec(member, task_dir, root / "logs" / f"{member}.log")


def _training(step: int, steps: int, eta_s: float) -> Progress:
    """A report whose ETA does not count down (no time of writing): exact figures."""
    return Progress("training", step, steps, 0.41, 312.0, eta_s)


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
    assert describe(progress) == "step 0/0"


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
    assert [format_duration(s) for s in (None, 4.4, 65, 7322)] == [
        "unknown", "4 s", "1 min 05 s", "2 h 02 min",
    ]  # fmt: skip


# -- the controller's display ------------------------------------------------------------------


def test_plain_lines_show_each_member_and_the_etas(tmp_path: Path):
    clock, said = Clock(), []
    display = ProgressDisplay(
        Plan(generation=1, generations=3, slots=2, mean_generation_s=100.0),
        say=said.append,
        terminal=False,
        every_s=10.0,
        clock=clock,
    )
    a = _task(tmp_path, "g001-m00", _training(3, 10, 12.0))
    b = _task(tmp_path, "g001-m01")  # started, nothing reported yet
    queued = [_task(tmp_path, "g001-m02")]
    with display:
        display.poll([a, b], queued)
        assert said == []  # the first lines come every_s after the start
        clock.now += 10.0
        display.poll([a, b], queued)
        assert said[:2] == [
            "  g001-m00 step 3/10 reward 0.410 312 tok/s eta 12 s",
            "  g001-m01 starting",
        ]
        assert said[2] == "  generation 1: 2 running, 1 queued; eta unknown; campaign eta unknown"
        clock.now += 5.0
        display.poll([a, b], queued)
        assert len(said) == 3  # not yet time
        # b reports, the queued member starts on the first slot to free: a's, in 12 s
        Heartbeat(b.task_dir / "heartbeat").report(_training(1, 10, 40.0).to_json())
        clock.now += 5.0
        display.poll([a, b], queued)
    # a's 12 s + the queued task's typical time (the running ones' elapsed + ETA: 32 and 60 s)
    # = 58 s; the campaign's adds one more generation at 100 s
    assert said[-1] == "  generation 1: 2 running, 1 queued; eta 58 s; campaign eta 2 min 38 s"


def test_ended_tasks_set_the_typical_time_and_no_lines_when_nothing_runs(tmp_path: Path):
    clock, said = Clock(), []
    plan = Plan(generation=0, generations=2, slots=1)
    display = ProgressDisplay(plan, say=said.append, terminal=False, every_s=1.0, clock=clock)
    first, second = _task(tmp_path, "g000-m00"), _task(tmp_path, "g000-m01")
    with display:
        display.poll([first], [second])
        clock.now += 30.0
        display.poll([], [second])  # the first ended after 30 s; nothing to show between
        assert said == []
    with display:  # the retry round
        display.poll([second], [])
        clock.now += 10.0
        display.poll([second], [])
    assert said == [
        "  g000-m01 starting",  # once: it is still starting 10 s later
        "  generation 0: 1 running, 0 queued; eta 30 s; campaign eta 1 min 30 s",
        # 30 s typical, 10 s elapsed: 20 s left; the first generation's estimate (40 + 20 s)
        # stands for the next one
        "  generation 0: 1 running, 0 queued; eta 20 s; campaign eta 1 min 20 s",
    ]


def test_bars_render_on_a_terminal(tmp_path: Path):
    clock, stream, said = Clock(), io.StringIO(), []
    plan = Plan(generation=0, generations=1, slots=2)
    display = ProgressDisplay(plan, say=said.append, stream=stream, terminal=True, clock=clock)
    a = _task(tmp_path, "g000-m00", _training(3, 10, 12.0))
    b = _task(tmp_path, "g000-m01", Progress("loading", steps=10))
    with display:
        display.poll([a, b], [])
        clock.now += 1.0
        display.poll([a], [])  # b ended
        drawn = stream.getvalue()
    assert said == []  # bars, no lines
    # b, loading, has no ETA, until it ends in 1 s: a's own 12 s then stand for the generation
    assert "generation 0: 2 running, 0 queued; eta unknown; campaign eta unknown" in drawn
    assert "generation 0: 1 running, 0 queued; eta 12 s; campaign eta 12 s" in drawn
    assert re.search(r"g000-m00 .*3/10, reward 0\.410 312 tok/s eta 12 s", drawn), drawn
    assert "g000-m01" in drawn and "loading" in drawn
    assert not display._bars and display._head is None  # cleared with the round


def test_plain_lines_say_each_thing_once(tmp_path: Path):
    """A member that is slow to start is said to be ``starting`` once, not every ``every_s``;
    the ETAs line too comes again only when it changes; a member's next step is a new line."""
    clock, said = Clock(), []
    plan = Plan(generation=0, generations=2, slots=2)
    display = ProgressDisplay(plan, say=said.append, terminal=False, every_s=1.0, clock=clock)
    a, b = _task(tmp_path, "g000-m00"), _task(tmp_path, "g000-m01")
    with display:
        for _ in range(6):  # a minute of loading, polled every 10 s
            clock.now += 10.0
            display.poll([a, b], [])
        assert said == [
            "  g000-m00 starting",
            "  g000-m01 starting",
            "  generation 0: 2 running, 0 queued; eta unknown; campaign eta unknown",
        ]
        Heartbeat(a.task_dir / "heartbeat").report(_training(1, 10, 30.0).to_json())
        clock.now += 10.0
        display.poll([a, b], [])
        assert said[3:] == ["  g000-m00 step 1/10 reward 0.410 312 tok/s eta 30 s"]  # b waits
        Heartbeat(b.task_dir / "heartbeat").report(_training(2, 10, 20.0).to_json())
        clock.now += 10.0
        display.poll([a, b], [])
        assert said[4:] == [
            "  g000-m01 step 2/10 reward 0.410 312 tok/s eta 20 s",
            # a's 30 s; this generation (80 s so far + 30 s) again for the next one
            "  generation 0: 2 running, 0 queued; eta 30 s; campaign eta 2 min 20 s",
        ]
    assert said.count("  g000-m00 starting") == 1


# -- pbt status --------------------------------------------------------------------------------


def test_status_shows_a_running_members_progress(tmp_path: Path):
    manifest = write_manifest(
        tmp_path / "manifest.yaml",
        {"INIT_HP": {"POP_SIZE": 2, "TOURNAMENT_SIZE": 2, "EVO_STEPS": 10, "LR": 1e-4}},
        tracking={"enabled": False},
    )
    directory = tmp_path / "c"
    campaign = Campaign.start(manifest, directory, member_command=["true"])
    try:
        for m in campaign.store.members(0):
            m.status, m.attempts = "running", 1
            campaign.store.update_member(m)
    finally:
        campaign.close()
    _task(directory, "g000-m00", _training(3, 10, 12.0))
    text = status_text(directory)
    running = text.split("running:\n", 1)[1].splitlines()
    assert re.fullmatch(
        r"  g000-m00  step 3/10 reward 0\.410 312 tok/s eta 12 s \(heartbeat 0 s ago\)  "
        r"log .*/logs/g000-m00\.attempt1\.log",
        running[0],
    ), running[0]
    assert running[1].startswith("  g000-m01  no heartbeat yet  log "), running[1]


# -- a real campaign, without a terminal -------------------------------------------------------


@pytest.mark.integration
def test_a_campaign_without_a_terminal_prints_step_lines_before_done(tmp_path: Path):
    """Two real members under torchrun on CPU, stdout a pipe: each member's step lines (from
    its heartbeat) come before its ``done`` line, which is printed as before."""
    manifest = tmp_path / "campaign.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "builtin:tiny"},
                "algorithm": {"group_size": 4, "prompts_per_step": 2},
                "rollout": {"max_output_tokens": 24},
                "task": {"name": "builtin:letters", "eval_size": 8},
                "training": {"seed": 3, "device": "cpu"},
                "population": {"size": 2, "tournament_size": 2, "evo_steps": 24},
                "budget": {"generations": 1},
                "launch": {"slots": 2, "max_attempts": 1},
                "tracking": {"enabled": False},
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "run", str(manifest), "--dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env={**os.environ, "PBT_PROGRESS_EVERY": "0.5", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for member in ("g000-m00", "g000-m01"):
        done = next(i for i, line in enumerate(lines) if line.startswith(f"  {member} done: "))
        steps = [
            line
            for line in lines[:done]
            if re.fullmatch(
                rf"  {member} step ([1-9]\d*)/24 reward \d\.\d{{3}} \d+ tok/s eta \d+ s", line
            )
        ]
        assert steps, out.stdout
    assert any(
        re.fullmatch(r"  generation 0: \d running, 0 queued; eta \d+ s; campaign eta \d+ s", line)
        for line in lines
    ), out.stdout
