"""The algorithm family on the tiny model: each one learns, runs as a 2-rank FSDP2 member,
evolves as a population, and runs as a campaign; the DAPO options and the mutable sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from support import DATA_VARIANTS, DRIVERS, RL_VARIANTS, run_torchrun, small_sections

from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError
from pbt.config.read.loader import manifest_from_dict
from pbt.library.create import create_population

CPU = torch.device("cpu")

RL = RL_VARIANTS
"""Every RL algorithm and loss (the torchrun driver runs them all)."""
DATA = DATA_VARIANTS


def _sections(tmp_path: Path, variant: dict, **more) -> dict:
    data = small_sections(tmp_path, **more)
    for section, values in variant.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def _learning_manifest(tmp_path: Path, variant: dict):
    """The quickstart's settings, shortened: 8 prompts x 8 completions x 12 tokens a step."""
    base = {
        "optim": {"lr": 5e-3},
        "algorithm": {"group_size": 8, "prompts_per_step": 8},
        "rollout": {"max_output_tokens": 12},
        "task": {"eval_size": 32},
    }
    data = small_sections(tmp_path)
    for source in (base, variant):
        for section, values in source.items():
            data[section] = {**data.get(section, {}), **values}
    return manifest_from_dict(data, base_dir=tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("variant", [v for v in RL if v != "ppo"])  # PPO: test_ppo.py
def test_rl_objective_learns(tmp_path, variant):
    """12 steps of the letters task: the held-out reward of the untrained adapter is 0.17 and a
    learned run of one letter scores 0.5; each objective must gain at least 0.15."""
    member = Member(_learning_manifest(tmp_path, RL[variant]), CPU)
    task, learner = member.task, member.learner
    before = learner.evaluate(task.eval, task.reward)
    for _ in range(12):
        learner.train_step(task.train, task.reward)
    after = learner.evaluate(task.eval, task.reward)
    assert after > before + 0.15, (variant, before, after)


@pytest.mark.integration
@pytest.mark.parametrize("variant", list(DATA))
def test_dataset_algorithm_learns(tmp_path, variant):
    """SFT: held-out NLL per response token falls by more than 1 nat in 20 steps; DPO: held-out
    preference accuracy rises from 0 (the adapter starts as the reference) above 0.8 (on 32
    pairs, chance at 0.5 would reach it with p < 0.001)."""
    member = Member(_learning_manifest(tmp_path, DATA[variant]), CPU)
    task, learner = member.task, member.learner
    before = learner.evaluate(task.eval)
    for _ in range(20):
        metrics = learner.train_step(task.train)
    after = learner.evaluate(task.eval)
    if variant == "sft":
        assert after > before + 1.0, (before, after, metrics)
    else:
        assert before == 0.0 and after > 0.8, (before, after, metrics)


def test_dapo_dynamic_sampling_fills_the_batch_with_signal(tmp_path):
    variant = {"algorithm": {"loss": "dapo", "dynamic_sampling": True, "max_resamples": 6}}
    member = Member(manifest_from_dict(_sections(tmp_path, variant), base_dir=tmp_path), CPU)
    metrics = member.learner.train_step(member.task.train, member.task.reward)
    assert metrics["zero_signal_fraction"] == 0.0
    assert metrics["resample_rounds"] >= 0 and "dropped_groups" in metrics


def test_overlong_penalty_shapes_rewards(tmp_path):
    variant = {"algorithm": {"overlong_buffer": 4, "overlong_penalty": 0.5}}
    member = Member(manifest_from_dict(_sections(tmp_path, variant), base_dir=tmp_path), CPU)
    learner, task = member.learner, member.task
    examples = learner.sample_prompts(task.train)
    torch.manual_seed(0)
    batch, shaped = learner.rollout(examples, task.reward)
    plain = learner.score(examples, batch, task.reward)
    lengths = batch.completion_mask.sum(dim=1)
    expected = -0.5 * ((lengths - 2).clamp(min=0) / 4).clamp(max=1.0)  # limit 6, buffer 4
    torch.testing.assert_close(shaped - plain, expected)


def test_mutable_hyperparameters_are_declared_per_algorithm(tmp_path):
    data = _sections(tmp_path, DATA["sft"])
    data["mutation"] = {"ranges": {"clip_low": {"min": 0.1, "max": 0.3}}}
    with pytest.raises(ConfigError, match="not a mutable hyperparameter of SFT; mutable: lr"):
        manifest_from_dict(data, base_dir=tmp_path)
    pop = create_population(config=_sections(tmp_path, DATA["dpo"]), population_size=2)
    assert set(pop[0].hyperparameters) == {"lr", "beta", "max_grad_norm"}
    data = _sections(tmp_path, {"algorithm": {"name": "DPO", "beta": 0.0}})
    with pytest.raises(ConfigError, match=r"algorithm.beta \(0.0\) must be > 0 for DPO"):
        manifest_from_dict(data, base_dir=tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["dapo", "rloo", "ppo", "sft", "dpo"])
def test_population_of_two_for_two_generations(tmp_path, variant):
    from pbt.library.loop import train_population

    config = _sections(tmp_path, {**RL, **DATA}[variant], population={"tournament_size": 2})
    pop = create_population(config=config, population_size=2)
    train_population(pop, steps=2, evo_steps=1, output_dir=tmp_path / "run", tracking=False)
    assert pop.generation == 1 and all(a.steps == 2 and len(a.fitness) == 2 for a in pop)
    assert all(a.fitness[-1] == a.fitness[-1] for a in pop)  # not NaN


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_every_algorithm_as_a_two_rank_member(tmp_path, mode):
    """One torchrun group of 2 ranks trains each algorithm 2 steps, FSDP2-sharded or data
    parallel, saves and evaluates; the ranks agree, and every checkpoint loads on one rank."""
    run_torchrun(str(DRIVERS / "algorithms_driver.py"), str(tmp_path), mode)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert sorted(ranks[0]) == sorted([*RL, *DATA])
    for variant, report in ranks[0].items():
        assert report["sharded"] is (mode == "fsdp") and len(report["losses"]) == 2, variant
        assert all(v == v for v in report["losses"] + [report["fitness"]]), variant
        member = Member(
            manifest_from_dict(_sections(tmp_path, {**RL, **DATA}[variant]), base_dir=tmp_path),
            CPU,
        )
        member.load(tmp_path / variant)
        assert member.learner.step == 2


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["rloo", "ppo", "sft", "dpo"])
def test_campaign_of_an_algorithm(tmp_path, variant):
    data = _sections(tmp_path, {**RL, **DATA}[variant])
    data |= {
        "population": {"size": 2, "tournament_size": 2, "evo_steps": 2},
        "budget": {"generations": 2},
        # long-lived workers: each algorithm through the slot inbox; a process per task is the
        # torchrun campaign tests' reference
        "launch": {"slots": 2, "persistent_workers": True},
        "tracking": {"enabled": False},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    out = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "run", str(path), "--dir", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "stopped: 2 generations done" in out.stdout
