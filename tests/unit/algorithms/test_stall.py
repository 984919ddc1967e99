"""``pbt train``'s warning when the reward has not moved after the first steps, naming the
likely causes in the order the metrics point at them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pbt.worker.stall import WATCH_STEPS, StallWatch


def _steps(rewards, zero_signal=0.5, length=10.0):
    return [
        {
            "reward_mean": r,
            "zero_signal_fraction": zero_signal,
            "skipped": float(zero_signal >= 1.0),
            "completion_length": length,
        }
        for r in rewards
    ]


def _watch(history, **kw) -> list[str]:
    args = {"steps": 100, "lr": 7e-5, "max_output_tokens": 48, "model": "some/model"} | kw
    watch = StallWatch(**args)
    said = [w for m in history if (w := watch.observe(m))]
    return said


def test_a_rising_reward_says_nothing_and_a_flat_one_says_so_once():
    rising = [0.05 + 0.02 * i for i in range(WATCH_STEPS)]
    assert _watch(_steps(rising)) == []
    flat = [0.02, 0.03] * (WATCH_STEPS // 2) * 2  # past the window: judged once
    (said,) = _watch(_steps(flat))
    assert said.startswith(
        "the training reward has not moved in 20 steps (mean 0.025 over steps 1-10, 0.025 over "
        "steps 11-20) and groups had signal in 20 steps. Likely causes: optim.lr (7e-05) too low"
    )
    assert said.endswith("See docs/own_task.md for settings that learn")


def test_the_causes_follow_the_metrics():
    flat = [0.0] * WATCH_STEPS
    (said,) = _watch(_steps(flat, zero_signal=1.0))
    assert "no group has had signal" in said
    assert said.index("the reward is always the same") < said.index("optim.lr")
    (said,) = _watch(_steps(flat, zero_signal=1.0), model="builtin:tiny")
    assert said.split("Likely causes: ")[1].startswith(
        "a model too weak for the task: builtin:tiny"
    )
    (said,) = _watch(_steps(flat, length=47.5))
    assert said.split("Likely causes: ")[1].startswith(
        "rollout.max_output_tokens (48) too short: completions average 47.5 tokens"
    )
    (said,) = _watch(_steps([0.1, 0.12] * 10), lr=5e-6, model="builtin:tiny")
    assert said.split("Likely causes: ")[1].startswith(
        "a model too weak for the task: builtin:tiny"
    )
    assert said.index("optim.lr (5e-06) too low") < said.index("the reward is always the same")
    (said,) = _watch(_steps([0.1, 0.12] * 10), lr=2e-4)  # a usual lr is not blamed
    assert "optim.lr" not in said and "a model too weak for the task: start from a larger" in said


def test_short_runs_and_algorithms_without_rewards_are_not_judged():
    assert _watch(_steps([0.0] * 19), steps=19) == []
    assert _watch([{"loss": 1.0}] * 30) == []


@pytest.mark.integration
def test_pbt_train_warns_when_nothing_is_learned(tmp_path):
    """AgileRL's tutorial learning rate on the built-in tiny model: a flat line, explained."""
    sections = {
        "model": {"name": "builtin:tiny"},
        "optim": {"lr": 5e-6},
        "algorithm": {"group_size": 4, "prompts_per_step": 2},
        "rollout": {"max_output_tokens": 6},
        "task": {"name": "builtin:letters", "eval_size": 4},
        "training": {"steps": 20, "output_dir": str(tmp_path / "out"), "device": "cpu"},
    }
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(sections))
    done = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "train", str(manifest)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, done.stdout
    assert warnings[0].startswith("warning: step 20: the training reward has not moved in 20")
    assert "a model too weak for the task: builtin:tiny has random weights" in warnings[0]
