"""Dedicated rollout engines and asynchronous rollouts on the tiny model: staleness 0 trains
exactly as a colocated member, a staleness bound drops what is too old and weights the rest,
an engine that dies or hangs is named and restarted once, and an AgileRL Arena manifest with
async engines runs as a campaign that resumes after a controller SIGKILL to the same decisions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support import FIXTURES, small_manifest

from pbt.algorithms.rollout.dedicated import behaviour_weights, dedicated_rollouts, fresh_rows
from pbt.algorithms.rollout.engine_place import device_label, engine_device, engine_placement
from pbt.algorithms.rollout.remote import RolloutEngineError
from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError
from pbt.config.read.loader import load_manifest
from pbt.protocol.engines import PLACEMENT_ENV, EnginePlacement, read_statuses

CPU = torch.device("cpu")
FIXTURE = FIXTURES / "agilerl" / "grpo_arena_async.yaml"
DEDICATED = {"launch": {"rollout_gpus_per_member": 1}}


def _adapter(member: Member) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in member.learner.named_params}


def _async(tmp_path: Path, staleness: int, **rollout) -> Member:
    rollout = {"mode": "async", "max_staleness": staleness, **rollout}
    return Member(small_manifest(tmp_path, rollout=rollout, **DEDICATED), CPU)


# -- the pieces, without an engine -------------------------------------------------------------


def test_rows_older_than_the_bound_are_dropped() -> None:
    versions = torch.tensor([5, 4, 3, 2, 0])
    assert fresh_rows(versions, 5, 2).tolist() == [True, True, True, False, False]
    assert fresh_rows(versions, 5, 0).tolist() == [True, False, False, False, False]


def test_stale_rows_are_weighted_per_token_or_per_sequence_and_fresh_rows_weigh_one() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.5, -1.0, -9.0], [-3.0, -0.5, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    stale = torch.tensor([True, False])
    weight, capped = behaviour_weights("grpo", trainer, sampler, stale, mask, cap=2.0)
    expected = torch.tensor([[min(2.0, float(torch.exp(torch.tensor(0.5)))), float(torch.exp(
        torch.tensor(-1.0))), 1.0], [1.0, 1.0, 1.0]])  # fmt: skip
    torch.testing.assert_close(weight, expected)
    assert capped.tolist() == [[False, False, False], [False, False, False]]
    assert torch.equal(weight[1], torch.ones(3))  # exactly: drawn with the trained adapter
    seq, _ = behaviour_weights("gspo", trainer, sampler, stale, mask, cap=2.0)
    mean = torch.exp(torch.tensor((0.5 - 1.0) / 2))  # the sequence's mean token log-ratio
    torch.testing.assert_close(seq[0], mean.expand(3))
    assert torch.equal(seq[1], torch.ones(3))
    tight, hit = behaviour_weights("grpo", trainer, sampler, stale, mask, cap=1.2)
    assert float(tight[0, 0]) == pytest.approx(1.2) and bool(hit[0, 0])


def test_bad_values_are_one_line_each(tmp_path) -> None:
    cases = [
        ({"rollout": {"max_staleness": 2}}, "rollout.max_staleness (2) needs rollout.mode: async"),
        ({"rollout": {"mode": "async"}}, "rollout.mode (async) samples on dedicated engines"),
        ({"rollout": {"max_staleness": -1}}, "rollout.max_staleness (-1) must be >= 0"),
        ({"launch": {"rollout_gpus_per_member": -1}}, "launch.rollout_gpus_per_member (-1)"),
        ({**DEDICATED, "rollout": {"engine": "vllm"}}, "rollout.engine ('vllm') runs colocated"),
        (
            {"launch": {"rollout_gpus_per_member": 2}},
            "launch.rollout_gpus_per_member (2) gives each of the member's 1 ranks its own "
            "engine: set it to 1",
        ),
        ({"launch": {"rollout_gpus_per_member": "all"}}, "launch.rollout_gpus_per_member"),
        ({**DEDICATED, "algorithm": {"dynamic_sampling": True}}, "algorithm.dynamic_sampling"),
        ({**DEDICATED, "algorithm": {"name": "PPO"}}, "serves the GRPO family's rollouts"),
        (
            {**DEDICATED, "task": {"env": {"class": "builtin:guess_number"}}},
            "task.env plays multi-turn episodes in the training process",
        ),
    ]
    for sections, start in cases:
        with pytest.raises(ConfigError) as err:
            small_manifest(tmp_path, **sections)
        assert any(start in p for p in err.value.problems), err.value.problems
        assert all("\n" not in p for p in err.value.problems)


def test_the_engine_runs_where_the_launcher_placed_it(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(PLACEMENT_ENV, raising=False)
    auto = small_manifest(tmp_path, launch={"rollout_gpus_per_member": "auto"})
    assert engine_placement(auto, CPU) == EnginePlacement("colocated", 0)  # sync: none
    auto_async = small_manifest(
        tmp_path, launch={"rollout_gpus_per_member": "auto"}, rollout={"mode": "async"}
    )
    assert engine_placement(auto_async, CPU) == EnginePlacement("cpu", 1)
    assert engine_placement(auto_async, torch.device("cuda", 0)) == EnginePlacement("shared", 1)
    monkeypatch.setenv(PLACEMENT_ENV, "dedicated:1")  # the launcher's word wins
    assert engine_placement(auto_async, CPU) == EnginePlacement("dedicated", 1)
    assert engine_placement(small_manifest(tmp_path), CPU).engines_per_member == 0
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # trainers 4, 5; engines 6, 7
    device = engine_device(EnginePlacement("dedicated", 2), torch.device("cuda", 1))
    assert device == "cuda:3" and device_label(device) == "cuda:3 (GPU 7)"
    shared = engine_device(EnginePlacement("shared", 2), torch.device("cuda", 1))
    assert shared == "cuda:1" and device_label(shared) == "cuda:1 (GPU 5)"
    assert engine_device(EnginePlacement("cpu", 2), CPU) == "cpu" == device_label("cpu")


def test_the_arena_fixture_maps_onto_dedicated_async_engines() -> None:
    m = load_manifest(FIXTURE)
    assert (m.launch.rollout_gpus_per_member, m.rollout.mode) == (1, "async")


# -- real engine processes ---------------------------------------------------------------------


@pytest.mark.integration
def test_staleness_0_trains_exactly_as_a_colocated_member(tmp_path) -> None:
    sync = Member(small_manifest(tmp_path), CPU)
    expected = sync.train(3)
    sync_rng = torch.get_rng_state()
    member = _async(tmp_path, 0)
    got = member.train(3)
    assert torch.equal(torch.get_rng_state(), sync_rng)  # the member's stream, as sampled
    assert [h["reward_mean"] for h in got] == [h["reward_mean"] for h in expected]
    a, b = _adapter(sync), _adapter(member)
    assert all(torch.equal(a[name], b[name]) for name in a)  # bit for bit, float32
    assert member.learner.data.state_dict() == sync.learner.data.state_dict()
    assert [h["stale_dropped"] for h in got] == [0.0] * 3
    assert member.host.rollout_engine.process.is_alive()  # kept for the host's next member
    member.host.rollout_engine.close()


@pytest.mark.integration
def test_staleness_2_drops_what_is_too_old_and_weights_the_rest(tmp_path) -> None:
    member = _async(tmp_path, 2)
    learner, train = member.learner, member.task.train
    rewards = torch.arange(8, dtype=torch.float32)  # every group has signal: the optimizer steps
    task_dir = tmp_path / "task"
    with dedicated_rollouts(member.host, learner, member.member_id, task_dir) as session:
        assert session.ahead == 2  # one optimizer step a training step
        (serving,) = read_statuses(task_dir)  # written as the session begins
        assert (serving.state, serving.pid, serving.trainer_pid, serving.device) == (
            "serving", member.host.rollout_engine.pid, os.getpid(), "cpu",
        )  # fmt: skip
        _, first, m0 = session.take(train)
        session.settle()  # the two batches requested ahead: drawn with version 0
        assert first.versions.tolist() == [0] * 8 and m0["rollout_staleness"] == 0
        fresh = learner.learn(first, rewards)
        assert fresh["optimizer_steps"] == 1 and fresh["is_weight_mean"] == 0.0  # none stale
        session.push(1)
        _, second, m1 = session.take(train)  # drawn with version 0, one step behind: kept
        assert second.versions.tolist() == [0] * 8 and m1["rollout_staleness"] == 1
        assert m1["stale_dropped"] == 0
        weighted = learner.learn(second, rewards)
        assert 0 < weighted["is_weight_mean"] <= 2.0 and weighted["logprob_gap"] > 0
        session.settle()
        session.push(2)  # version 3: the third batch (version 0) is 3 behind, past the bound
        _, third, m2 = session.take(train)
        assert m2["stale_dropped"] == 8 and third.versions.tolist() == [3] * 8
        assert m2["rollout_staleness"] == 0
        deadline = time.monotonic() + 5.0  # the reporter rewrites the file every second
        while read_statuses(task_dir)[0].stale_dropped != 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        seen = read_statuses(task_dir)[0]
        assert (seen.stale_dropped, seen.version, seen.state) == (8, 3, "serving")
        _, fourth, m3 = session.take(train)  # requested at version 1, two behind: kept
        assert fourth.versions.min() >= 1 and m3["rollout_staleness"] <= 2
        pending = session.pending[0].data_state
    assert learner.data.state_dict() == pending  # drained: rewound to the prompts not learned
    assert read_statuses(task_dir)[0].state == "drained"
    member.host.rollout_engine.close()


@pytest.mark.integration
def test_an_engine_killed_or_hung_is_named_restarted_once_then_fails_the_member(
    tmp_path, capfd
) -> None:
    sync = Member(small_manifest(tmp_path), CPU)
    sync.train(3)
    member = _async(tmp_path, 0, engine_heartbeat_s=3.0)

    def kill_mid_rollout(step: int, _metrics) -> None:
        if step == 1:  # the next step's request goes out at once; the engine dies under it
            pid = member.host.rollout_engine.pid
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
            time.sleep(0.01)

    member.train(3, on_step=kill_mid_rollout)
    engine = member.host.rollout_engine
    assert engine.restarts == 1
    out = capfd.readouterr().out
    assert "member-0's rollout engine 0 (pid" in out and "restarting it" in out
    assert "died (exit code -9)" in out or "sent a broken reply" in out
    a, b = _adapter(sync), _adapter(member)
    assert all(torch.equal(a[name], b[name]) for name in a)  # the restart resampled exactly
    os.kill(engine.pid, signal.SIGSTOP)  # hung: a second failure fails the member
    try:
        with pytest.raises(RolloutEngineError) as err:
            member.train(1)
    finally:
        engine.kill()
    line = str(err.value)
    assert "\n" not in line and "member-0's rollout engine 0 (pid" in line
    assert "is hung: no heartbeat" in line and "restarted once already" in line


@pytest.mark.integration
def test_the_arena_manifest_runs_and_resumes_after_a_controller_sigkill(tmp_path) -> None:
    """``pbt check`` and ``pbt run`` of an Arena manifest with async engines; the same run
    SIGKILLed after generation 0's selection and resumed makes the same decisions."""
    from pbt.controller.store import CampaignStore

    pbt = [sys.executable, "-m", "pbt.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    check = subprocess.run([*pbt, "check", str(FIXTURE)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    def decisions(directory: Path) -> list[tuple]:
        with CampaignStore(directory / "store.db") as store:
            return [
                (m.member_id, m.parent_id, m.hyperparameters, m.mutation, m.fitness_history)
                for m in store.members()
            ]

    straight = tmp_path / "straight"
    run = subprocess.run(
        [*pbt, "run", str(FIXTURE), "--dir", str(straight)], capture_output=True, text=True,
        env=env, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logs = "".join(p.read_text() for p in (straight / "logs").glob("*.log"))
    assert "engine v" in logs and " behind" in logs  # the members sampled on their engines
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [*pbt, "run", str(FIXTURE), "--dir", str(killed)], capture_output=True, text=True,
        env={**env, "PBT_CRASH_AT": "selection:1"}, timeout=900,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    resumed = subprocess.run(
        [*pbt, "resume", str(killed)], capture_output=True, text=True, env=env, timeout=900
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert decisions(killed) == decisions(straight)
    assert len(decisions(straight)) == 4  # 2 members x 2 generations
