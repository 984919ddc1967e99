"""A library-mode population with ``launch.members_per_batch``: its members' rollouts in one
batch give every member exactly what taking turns gives, step after step (tokens, adapters,
random streams), on the static and HF engines (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from support import small_manifest, small_sections

from pbt import create_population
from pbt.config.errors import ConfigError


def _population(tmp_path, engine: str, per_batch: int):
    sections = small_sections(
        tmp_path,
        rollout={"engine": engine, "max_output_tokens": 12},
        launch={"members_per_batch": per_batch},
        optim={"lr": 5e-2},
        population={"tournament_size": 2},
    )
    return create_population(config=sections, population_size=3)


def _steps(pop, steps: int) -> list[dict[str, list]]:
    """``steps`` AgileRL-style steps of every agent (prompts, one ``get_actions``, rewards,
    learn); each step's completions and the adapters after."""
    temperatures = [1.0, 0.6, 1.4]
    for agent, t in zip(pop, temperatures, strict=True):
        agent.set_hyperparameters({"temperature": t})
    seen = []
    for _ in range(steps):
        prompts = {agent: agent.sample_prompts() for agent in pop}
        batches = pop.get_actions(prompts)
        for agent, batch in batches.items():
            agent.learn(batch, agent.reward(prompts[agent], batch))
        seen.append({agent.member_id: batches[agent].completion_ids for agent in pop})
    adapters = {}
    for agent in pop:
        agent._activate()
        adapters[agent.member_id] = [p.detach().clone() for p in pop._shared().params]
    greedy = pop.get_actions({agent: ["spell cat", "a b c"] for agent in pop}, training=False)
    seen.append({a.member_id: greedy[a].completion_ids for a in pop})
    return seen, adapters


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_batched_population_trains_as_taking_turns(tmp_path, engine):
    turns, turn_adapters = _steps(_population(tmp_path / "turns", engine, 1), 2)
    pop = _population(tmp_path / "batched", engine, 3)
    batched, batch_adapters = _steps(pop, 2)
    assert pop._shared().row_adapters is not None  # the rollouts went through one batch
    for step_turns, step_batched in zip(turns, batched, strict=True):
        for member_id, ids in step_turns.items():
            assert torch.equal(ids, step_batched[member_id]), member_id
    for member_id, tensors in turn_adapters.items():
        assert all(
            torch.equal(a, b) for a, b in zip(tensors, batch_adapters[member_id], strict=True)
        )
    first = next(iter(turn_adapters.values()))
    assert not all(
        torch.equal(a, b) for a, b in zip(first, list(turn_adapters.values())[1], strict=True)
    )  # the members learned apart


def test_members_per_batch_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"launch\.members_per_batch"):
        create_population(
            config=small_sections(tmp_path, launch={"members_per_batch": 0}), population_size=2
        )


def test_a_campaign_manifest_is_told_where_members_per_batch_applies(tmp_path):
    persistent = small_manifest(tmp_path, launch={"members_per_batch": 4})
    assert not any("members_per_batch" in n for n in persistent.notes())  # workers batch
    alone = small_manifest(tmp_path, launch={"members_per_batch": 4, "persistent_workers": False})
    assert any(n.startswith("launch.members_per_batch (4) batches") for n in alone.notes())
    assert not any("members_per_batch" in n for n in small_manifest(tmp_path).notes())
    unbatched = small_manifest(tmp_path, launch={"batched_train": True})
    assert any(n.startswith("launch.batched_train (true)") for n in unbatched.notes())
    slurm = small_manifest(tmp_path, launch={"members_per_batch": 4, "backend": "slurm"})
    assert any(
        n.startswith("launch.members_per_batch (4) batches members on") for n in slurm.notes()
    )
    kernel = small_manifest(tmp_path, launch={"lora_kernel": "stacked"})
    assert any(n.startswith("launch.lora_kernel (stacked)") for n in kernel.notes())
    batched = small_manifest(tmp_path, launch={"lora_kernel": "stacked", "members_per_batch": 2})
    assert not batched.notes()
    ranks = small_manifest(tmp_path, launch={"members_per_batch": 4, "nproc_per_member": 2})
    assert "launch.members_per_batch (4) has no effect with 2 ranks a member" in ranks.notes()[0]
    together = {"members_per_batch": 2, "batched_train": True}
    assert not small_manifest(tmp_path, launch=together).notes()
    dropout = small_manifest(tmp_path, launch=together, lora={"dropout": 0.1})
    (note,) = dropout.notes()
    assert note.startswith("launch.batched_train (true) needs") and "lora.dropout 0.1" in note
