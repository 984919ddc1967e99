"""Mutable group size and prompts per step: whole-number mutations that keep the batch rules,
and an optimizer step that is exact when a child's group size differs from its parent's."""

from __future__ import annotations

import random

import pytest
import torch
from support import small_manifest, small_sections

from pbt import create_population
from pbt.algorithms import losses
from pbt.algorithms.rollout.hf import sequence_logprobs
from pbt.algorithms.runtime.checkpoint import load_checkpoint, peft_key
from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError
from pbt.config.ranges import base_hyperparameters, batch_rule, keep_batch_rule
from pbt.distributed.state import load_parameters
from pbt.evolution.breeding import build_mutations
from pbt.protocol.messages import TaskMessage
from pbt.worker.task import run_task

CPU = torch.device("cpu")


def _ranges(tmp_path, algorithm=None, launch=None, **ranges):
    sections = {"mutation": {"ranges": ranges, "no_mutation": 0.0, "rl_hp": 1.0}}
    if algorithm:
        sections["algorithm"] = algorithm
    if launch:
        sections["launch"] = launch
    return small_manifest(tmp_path, **sections)


def _mutated(manifest, name: str, value: int, seeds: int = 40) -> set:
    mutations = build_mutations(manifest)
    parent = base_hyperparameters(manifest) | {name: value}
    return {mutations.mutate(parent, random.Random(s))[0][name] for s in range(seeds)}


def test_group_size_moves_as_an_int_within_bounds(tmp_path):
    manifest = _ranges(tmp_path, group_size={"min": 2, "max": 16})
    assert base_hyperparameters(manifest)["group_size"] == 4
    assert _mutated(manifest, "group_size", 4) == {5, 3}  # 4 x 1.2 = 4.8; 4 x 0.8 = 3.2
    assert _mutated(manifest, "group_size", 2) == {3, 2}  # grows a step; 2 is GRPO's floor
    assert _mutated(manifest, "group_size", 16) == {16, 13}
    values = _mutated(manifest, "group_size", 8)
    assert all(type(v) is int for v in values)
    ppo = _ranges(tmp_path, algorithm={"name": "PPO"}, group_size={"min": 1, "max": 4})
    assert _mutated(ppo, "group_size", 2) == {3, 1}  # the critic is PPO's baseline


def test_mutation_keeps_the_batch_dividing(tmp_path):
    # 2 prompts x group_size completions must split into mini-batches of 8
    manifest = _ranges(tmp_path, algorithm={"mini_batch_size": 8}, group_size={"min": 2, "max": 16})
    assert _mutated(manifest, "group_size", 4) == {8, 4}  # 5, 6, 7 and 3, 2 break the rule
    assert _mutated(manifest, "group_size", 8, seeds=60) == {12, 4}
    # prompts per step split over the member's two ranks
    two = _ranges(tmp_path, launch={"nproc_per_member": 2}, prompts_per_step={"min": 2, "max": 9})
    assert _mutated(two, "prompts_per_step", 2) == {4, 2}
    assert _mutated(two, "prompts_per_step", 8) == {8, 6}  # 9.6 -> 9 is odd; 10 is out of range
    rule = batch_rule(two)
    assert rule({"prompts_per_step": 3}) and not rule({"prompts_per_step": 4})


def test_bad_whole_number_ranges_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"group_size.dtype \('float'\) must be 'int'"):
        _ranges(tmp_path, group_size={"min": 2, "max": 16, "dtype": "float"})
    with pytest.raises(ConfigError, match="holds no value the batch rules allow"):
        _ranges(
            tmp_path,
            algorithm={"mini_batch_size": 32, "group_size": 16},
            group_size={"min": 2, "max": 12},
        )
    with pytest.raises(ConfigError, match="not a mutable hyperparameter of SFT"):
        _ranges(tmp_path, algorithm={"name": "SFT"}, group_size={"min": 2, "max": 8})


def _fresh_copy(tmp_path, checkpoint, group_size: int) -> Member:
    """A new member built with ``group_size`` holding the checkpoint's adapter and learner
    state (optimizer, schedule, generator, data position), its hyperparameters not applied."""
    member = Member(small_manifest(tmp_path, algorithm={"group_size": group_size}), CPU)
    attrs = load_checkpoint(checkpoint)
    named = member.learner.named_params
    load_parameters(named, {n: attrs["trainable"][peft_key(n)] for n, _ in named})
    member.learner.load_state_dict(attrs["learner"])
    return member


def _adapter(member: Member) -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in member.learner.named_params]


def test_child_with_a_new_group_size_steps_exactly_as_a_fresh_learner(tmp_path):
    parent = Member(small_manifest(tmp_path), CPU)  # 2 prompts x 4 completions
    parent.train(2)
    parent.save(tmp_path / "ckpt")
    child = Member(small_manifest(tmp_path), CPU)
    child.load(tmp_path / "ckpt")
    child.learner.apply_hyperparameters({"group_size": 8})  # as a mutated child's task does
    assert child.learner.hyperparameters()["group_size"] == 8
    assert type(child.learner.algorithm.group_size) is int
    assert child.learner.scheduler.last_epoch == 2  # schedule and Adam state carried over
    assert all(int(s["step"]) == 2 for s in child.learner.optimizer.state.values())

    batch = child.learner.complete([ex.chat for ex in child.task.train[:2]])
    assert len(batch) == 16  # the rollout samples the new group size
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 0, 1, 0, 1])
    fresh = _fresh_copy(tmp_path, tmp_path / "ckpt", group_size=8)
    stale = _fresh_copy(tmp_path, tmp_path / "ckpt", group_size=4)
    got = child.learner.learn(batch, rewards)
    want = fresh.learner.learn(batch, rewards)
    stale.learner.learn(batch, rewards)
    assert all(torch.equal(a, b) for a, b in zip(_adapter(child), _adapter(fresh), strict=True))
    assert got == want
    assert child.learner.scheduler.last_epoch == fresh.learner.scheduler.last_epoch == 3
    assert not all(torch.equal(a, b) for a, b in zip(_adapter(child), _adapter(stale), strict=True))

    # the step computed directly with groups of 8: the clipped surrogate at ratio 1 is -A per
    # token, averaged over every token of the batch, then Adam from the parent's moments
    manual = _fresh_copy(tmp_path, tmp_path / "ckpt", group_size=8)
    advantages, signal = losses.group_advantages(rewards, 8)
    assert bool(signal.all())  # one group of 8 spans the equal 0.5s
    manual.model.train()
    logp = sequence_logprobs(manual.model, batch, manual.learner.rollout_cfg.temperature)
    mask = batch.completion_mask
    ratio = torch.exp(logp - logp.detach())
    loss = (-ratio * advantages.unsqueeze(1) * mask).sum() / mask.sum()
    loss.backward()
    manual.learner._optimizer_step(float(loss.detach()))
    for a, b in zip(_adapter(child), _adapter(manual), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    # a size that breaks a rule is refused, and nothing changes
    with pytest.raises(ConfigError, match=r"algorithm.group_size \(1\) must be >= 2"):
        child.learner.apply_hyperparameters({"group_size": 1, "lr": 0.5})
    assert child.learner.algorithm.group_size == 8 and child.learner.optim_cfg.lr != 0.5


def test_campaign_task_applies_a_mutated_group_size_after_loading(tmp_path):
    campaign = tmp_path / "campaign"
    parent = Member(small_manifest(tmp_path), CPU)
    parent.train(1)
    parent.save(campaign / "checkpoints" / "parent")
    hyperparameters = parent.learner.hyperparameters() | {"group_size": 6, "prompts_per_step": 1}
    task = TaskMessage(
        campaign_dir=str(campaign),
        manifest=small_sections(tmp_path),
        manifest_base_dir=str(tmp_path),
        member_id="g001-m00",
        parent_checkpoint="checkpoints/parent",
        parent_digest=None,
        parent_id="g000-m00",
        generation=1,
        mutation="group_size x1.5 (4 -> 6)",
        hyperparameters=hyperparameters,
        steps=1,
        checkpoint="checkpoints/g001-m00",
    )
    result, _ = run_task(task)
    assert result.status == "ok" and result.steps == 2
    saved = load_checkpoint(campaign / "checkpoints" / "g001-m00")["hyperparameters"]
    assert saved["group_size"] == 6 and type(saved["group_size"]) is int
    assert saved["prompts_per_step"] == 1 and type(saved["prompts_per_step"]) is int


def test_library_population_mutates_group_size_and_trains_on(tmp_path):
    sections = small_sections(
        tmp_path,
        population={"tournament_size": 2},
        mutation={
            "ranges": {"group_size": {"min": 2, "max": 8}},
            "no_mutation": 0.0,
            "rl_hp": 1.0,
        },
    )
    pop = create_population(config=sections, population_size=2)
    for agent, fitness in zip(pop, [0.2, 0.8], strict=True):
        agent.train_step()
        agent.fitness.append(fitness)
    pop = pop.evolve()
    child = pop[1]
    size = child.hyperparameters["group_size"]
    assert child.mutation.startswith("group_size ") and size in (3, 5)
    assert type(size) is int
    child.train_step()
    assert child.steps == 2
    batch = child.get_action(child.sample_prompts())
    assert len(batch) == 2 * size
    shared = pop.get_actions({agent: agent.sample_prompts() for agent in pop})
    assert [len(b) for b in shared.values()] == [2 * 4, 2 * size]


def test_drawn_sizes_move_to_the_nearest_allowed_value(tmp_path):
    manifest = _ranges(tmp_path, algorithm={"mini_batch_size": 8}, group_size={"min": 2, "max": 16})
    ranges, rule = build_mutations(manifest).ranges, batch_rule(manifest)
    base = base_hyperparameters(manifest)
    assert keep_batch_rule(base | {"group_size": 5}, ranges, rule)["group_size"] == 4
    assert keep_batch_rule(base | {"group_size": 7}, ranges, rule)["group_size"] == 8
    assert keep_batch_rule(base | {"group_size": 12}, ranges, rule)["group_size"] == 12
