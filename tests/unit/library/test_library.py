"""Library mode: a population on one shared base model, driven by hand or by train_population."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import DRIVERS, REPO, run_torchrun, small_sections

from pbt import GRPO, create_population, train_population
from pbt.algorithms.runtime.checkpoint import load_checkpoint
from pbt.config.errors import ConfigError, PbtError
from pbt.protocol.messages import TaskMessage
from pbt.worker.task import run_task


def _population(tmp_path, size=2, **sections):
    sections.setdefault("population", {"tournament_size": min(2, size)})
    return create_population(config=small_sections(tmp_path, **sections), population_size=size)


def _adapter(agent) -> list[torch.Tensor]:
    """The agent's adapter tensors, read through the shared slot."""
    agent._activate()
    return [p.detach().clone() for p in agent.population._shared().params]


def _probe_logits(agent) -> torch.Tensor:
    member = agent._activate()
    ids = member.tokenizer(["Write the letter q over and over."], return_tensors="pt")
    with torch.no_grad():
        return member.model(**ids).logits


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_create_population_is_lazy_and_imports_no_torch(tmp_path):
    code = (
        "import sys\n"
        "from pbt import create_population\n"
        "pop = create_population(INIT_HP={'LR': 1e-4, 'FSDP': True}, population_size=3)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print([a.member_id for a in pop], pop[0].hyperparameters['lr'], pop[0].steps)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.split("]")[0] == "['g000-m00', 'g000-m01', 'g000-m02'"
    assert out.stdout.split()[-2:] == ["0.0001", "0"]


def test_algorithm_population_takes_agilerl_arguments(tmp_path):
    pop = GRPO.population(
        3,
        model_name="builtin:tiny",
        pad_token="<|endoftext|>",
        pad_token_id=0,
        fsdp_config={"reshard_after_forward": False},
        lr=2e-3,
        GROUP_SIZE=4,
        hp_config={"lr": {"min": 1e-4, "max": 1e-2, "log": True}},
        config={"task": {"eval_size": 4}},
    )
    assert len(pop) == 3 and pop.manifest.algorithm.group_size == 4
    assert pop.manifest.distributed.fsdp == {"reshard_after_forward": False}
    assert [a.hyperparameters["lr"] for a in pop] == [2e-3] * 3
    with pytest.raises(ConfigError) as err:
        GRPO.population(2, lr=-1, GROUPSIZE=4)
    text = str(err.value)
    assert "INIT_HP.GROUPSIZE is not a known key" in text and "GROUP_SIZE" in text
    assert "optim.lr (-1.0) must be > 0" in text


def test_wrong_pad_token_id_is_refused_with_the_right_id(tmp_path):
    pop = _population(tmp_path, size=1, model={"pad_token_id": 5})
    with pytest.raises(ConfigError, match=r"pad_token_id \(5\) is not the id of the pad token"):
        pop[0].test()


def test_members_train_independently_on_one_base(tmp_path):
    pop = _population(tmp_path, size=2, optim={"lr": 2e-2})
    a, b = pop
    start_a, start_b = _adapter(a), _adapter(b)
    assert _same(start_a, start_b)  # both start from the initial adapter
    logits_b = _probe_logits(b)
    for _ in range(2):
        a.train_step()
    assert not _same(_adapter(a), start_a)
    assert _same(_adapter(b), start_b), "training a changed b's adapter"
    assert torch.equal(_probe_logits(b), logits_b), "training a changed b's outputs"
    assert b.steps == 0 and a.steps == 2
    logits_a = _probe_logits(a)
    b.train_step()
    assert torch.equal(_probe_logits(a), logits_a), "training b changed a's outputs"
    assert not _same(_adapter(a), _adapter(b))
    # each member's optimizer holds only its own state, over the one shared parameter set
    engine = pop._shared()
    opt_a = engine.member(a.member_id).learner.optimizer
    opt_b = engine.member(b.member_id).learner.optimizer
    assert opt_a is not opt_b
    assert [p for g in opt_a.param_groups for p in g["params"]] == engine.params
    for p in engine.params:
        assert opt_a.state[p]["exp_avg"] is not opt_b.state[p]["exp_avg"]
        assert not torch.equal(opt_a.state[p]["step"], opt_b.state[p]["step"])


def test_reference_policy_is_the_base_for_every_member(tmp_path):
    pop = _population(tmp_path, size=2, optim={"lr": 2e-2})
    base = _probe_logits(pop[0])
    pop[0].train_step()
    pop[1].train_step()
    for agent in pop:
        member = agent._activate()
        with member.model.disable_adapter():
            assert torch.allclose(_probe_logits(agent), base, atol=1e-6)
        assert not torch.allclose(_probe_logits(agent), base, atol=1e-6)


@pytest.mark.integration
def test_population_of_four_costs_about_one_member_of_memory():
    script = REPO / "bench" / "shared_base_memory.py"
    command = [sys.executable, str(script), "--shape", "wide", "--members", "4", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    model = r["shared"]["model_bytes"]
    shared, separate = r["shared"], r["separate"]
    print(json.dumps(r, indent=1))
    # one model per member: every further member costs about a model ...
    assert separate["per_further_member"] > 0.8 * model
    # ... on one shared base, an adapter and its Adam moments (~7% of this model)
    assert shared["per_further_member"] < 0.15 * model
    assert shared["grown"] < 1.3 * shared["first"]
    assert r["separate_over_shared"] > 2.0


def test_clone_copies_adapter_and_optimizer_and_then_diverges(tmp_path):
    pop = _population(tmp_path, size=1, optim={"lr": 2e-2})
    parent = pop[0]
    parent.train_step()
    parent.test()
    child = parent.clone()
    engine = pop._shared()
    assert _same(_adapter(child), _adapter(parent))
    assert child.fitness == parent.fitness and child.steps == parent.steps == 1
    assert child.parent_id == parent.member_id
    opt_p = engine.member(parent.member_id).learner.optimizer
    opt_c = engine.member(child.member_id).learner.optimizer
    for p in engine.params:
        assert torch.equal(opt_p.state[p]["exp_avg"], opt_c.state[p]["exp_avg"])
        assert opt_p.state[p]["exp_avg"] is not opt_c.state[p]["exp_avg"]
    before = _adapter(parent)
    child.train_step()
    assert _same(_adapter(parent), before)
    assert not _same(_adapter(child), before)


def test_select_and_mutate_a_population(tmp_path):
    pop = _population(tmp_path, size=4, optim={"lr": 1e-3}, mutation={"rl_hp": 1.0})
    for agent, fitness in zip(pop, [0.1, 0.9, 0.3, 0.2], strict=True):
        agent.train_step()
        agent.fitness.append(fitness)
    best = pop[1]
    best_adapter = _adapter(best)
    old = list(pop)
    pop = pop.tournament.select(pop)
    assert pop.generation == 1
    assert [a.member_id for a in pop] == [f"g001-m{i:02d}" for i in range(4)]
    assert pop.elite is pop[0] and pop[0].parent_id == best.member_id and pop[0].is_elite
    assert _same(_adapter(pop[0]), best_adapter)
    assert set(pop._shared().members) == {a.member_id for a in pop}  # the old ones are freed
    with pytest.raises(PbtError, match="was removed from its population"):
        old[0].train_step()
    pop = pop.mutations.mutation(pop)
    assert pop[0].mutation == "none (elite)"
    for agent in pop[1:]:
        assert agent.mutation.startswith("lr ")
        learner = pop._shared().member(agent.member_id).learner
        assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(agent.hyperparameters["lr"])
        assert agent.hyperparameters["lr"] != 1e-3
    for agent in pop:
        agent.train_step()  # every clone trains on


def test_library_checkpoint_resumes_exactly(tmp_path):
    straight = _population(tmp_path, size=1)[0]
    for _ in range(4):
        straight.train_step()
    first = _population(tmp_path, size=1)[0]
    for _ in range(2):
        first.train_step()
    first.save_checkpoint(tmp_path / "ck")
    resumed = _population(tmp_path, size=1)[0]
    resumed.load_checkpoint(tmp_path / "ck")
    for _ in range(2):
        resumed.train_step()
    assert resumed.steps == 4
    assert _same(_adapter(resumed), _adapter(straight))


def _task(tmp_path, campaign, member_id, parent, hyperparameters, steps=1):
    return TaskMessage(
        campaign_dir=str(campaign),
        manifest=small_sections(tmp_path),
        manifest_base_dir=str(tmp_path),
        member_id=member_id,
        parent_checkpoint=parent,
        parent_digest=None,
        parent_id=None,
        generation=1,
        mutation="none",
        hyperparameters=hyperparameters,
        steps=steps,
        checkpoint=f"checkpoints/{member_id}",
    )


def test_checkpoints_move_between_library_and_campaign(tmp_path):
    campaign = tmp_path / "campaign"
    # library -> campaign: a campaign member task starts from a library checkpoint
    agent = _population(tmp_path, size=1, optim={"lr": 1e-2})[0]
    agent.train_step()
    agent.test()
    agent.save_checkpoint(campaign / "checkpoints" / "from-library")
    saved = load_checkpoint(campaign / "checkpoints" / "from-library")
    assert saved["step"] == 1 and saved["fitness"] == agent.fitness
    assert saved["mutation_ranges"]["lr"]["min"] > 0
    result, _ = run_task(
        _task(tmp_path, campaign, "g001-m00", "checkpoints/from-library", agent.hyperparameters)
    )
    assert result.status == "ok" and result.steps == 2
    # campaign -> library: an agent becomes the campaign's member
    trained = load_checkpoint(campaign / "checkpoints" / "g001-m00")
    other = _population(tmp_path, size=1)[0]
    other.load_checkpoint(campaign / "checkpoints" / "g001-m00")
    assert other.steps == 2 and other.fitness == trained["fitness"]
    assert other.hyperparameters["lr"] == pytest.approx(1e-2)
    member = other._activate()
    named = dict(member.learner.named_params)
    for name, tensor in trained["trainable"].items():
        key = name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(named[key].detach(), tensor), name
    # and it keeps training from there
    other.train_step()
    assert other.steps == 3


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    agent = _population(tmp_path, size=1)[0]
    agent.save_checkpoint(tmp_path / "ck")
    other = _population(tmp_path, size=1, lora={"r": 4})[0]
    with pytest.raises(PbtError, match="lora_config"):
        other.load_checkpoint(tmp_path / "ck")


def _loop_population(tmp_path, **sections):
    base = {"population": {"tournament_size": 2}, "mutation": {"rl_hp": 1.0}}
    return create_population(config=small_sections(tmp_path, **base, **sections), population_size=3)


def test_train_population_evaluates_before_every_selection(tmp_path, monkeypatch):
    from pbt.library.population import Agent, Population

    tested, selected = [], []
    real_test, real_next = Agent.test, Population.next_generation

    def test(agent, *args, **kwargs):
        tested.append(agent.steps)
        return real_test(agent, *args, **kwargs)

    def next_generation(pop, chosen):
        # every member's last evaluation was made at the step selection happens
        selected.append([(a.steps, len(a.fitness)) for a in pop])
        return real_next(pop, chosen)

    monkeypatch.setattr(Agent, "test", test)
    monkeypatch.setattr(Population, "next_generation", next_generation)
    pop = _loop_population(tmp_path)
    out = tmp_path / "run"
    train_population(pop, steps=6, evo_steps=2, eval_every=3, output_dir=out, tracking=False)
    assert sorted(set(tested)) == [2, 3, 4, 6]  # evolutions at 2 and 4, evaluations at 3 and 6
    assert [sorted({s for s, _ in gen}) for gen in selected] == [[2], [4]]
    assert [len(a.fitness) for a in pop] == [4, 4, 4] and pop.generation == 2
    assert all(a.steps == 6 for a in pop)
    # on disk: one checkpoint per member of the last save, and the state that names them
    state = json.loads((out / "population.json").read_text())
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == sorted(Path(m["checkpoint"]).name for m in state["members"])
    assert len(names) == 3 and state["step"] == 6


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple:
    """One uninterrupted, tracked run of 4 steps (2 generations), its population and folder:
    the resume test's reference and the MLflow test's run (tracking changes no decision)."""
    folder = tmp_path_factory.mktemp("straight")
    pop = train_population(
        _loop_population(folder), steps=4, evo_steps=2, output_dir=folder / "run"
    )
    return pop, folder / "run"


def test_train_population_resumes_exactly(tmp_path, straight):
    straight, _ = straight
    out = tmp_path / "b"
    first = train_population(
        _loop_population(tmp_path), steps=2, evo_steps=2, output_dir=out, tracking=False
    )
    assert first.generation == 0 and all(a.steps == 2 for a in first)
    resumed = train_population(
        _loop_population(tmp_path), steps=4, evo_steps=2, output_dir=out, tracking=False
    )
    assert [a.member_id for a in resumed] == [a.member_id for a in straight]
    for a, b in zip(resumed, straight, strict=True):
        assert a.fitness == b.fitness and a.hyperparameters == b.hyperparameters
        assert a.parent_id == b.parent_id and a.mutation == b.mutation and a.steps == 4
        assert _same(_adapter(a), _adapter(b))
    # a population of another model refuses the folder instead of mixing with it
    with pytest.raises(ConfigError, match="holds a population with base_model"):
        train_population(
            _loop_population(tmp_path, model={"name": "example-org/another-model"}),
            steps=4,
            output_dir=out,
            tracking=False,
        )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_train_population_draws_a_bar_while_a_member_trains_on_a_terminal(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    pop = _population(tmp_path)
    train_population(pop, steps=2, evo_steps=2, output_dir=tmp_path / "run", tracking=False)
    drawn = terminal.getvalue()
    for member in ("g000-m00", "g000-m01"):
        bar = rf"  {member}: +\d+%\|.*\| [12]/2 \[.*, reward \d\.\d{{3}} \d+ tok/s\]"
        assert re.search(bar, drawn), drawn
        assert re.search(rf"\] +{member} step 2: reward", drawn), drawn  # its line, as before


def test_train_population_rejects_bad_intervals(tmp_path):
    with pytest.raises(ConfigError) as err:
        train_population(_loop_population(tmp_path), steps=0, evo_steps=-1, tracking=False)
    assert "steps (0) must be an integer >= 1" in str(err.value)
    assert "evo_steps (-1)" in str(err.value)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_shared_population_under_torchrun(tmp_path, mode):
    driver = DRIVERS / "library_driver.py"
    args = [str(tmp_path / "out"), str(tmp_path / "ck")] + (["--fsdp"] if mode == "fsdp" else [])
    run_torchrun(str(driver), *args, timeout=300)
    ranks = [json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["sharded"] is (mode == "fsdp")
    for key in ("members", "fitness", "steps", "adapters"):
        assert ranks[0][key] == ranks[1][key], key  # the ranks of one group agree
    report = ranks[0]
    assert report["members"] == ["g001-m00", "g001-m01"] and report["steps"] == [2, 2]
    assert report["adapters"][0] == report["adapters"][1]  # the load replaced the adapter
    # the checkpoint a 2-rank population saved loads into a 1-rank one
    agent = _population(tmp_path, size=1, optim={"lr": 1e-2})[0]
    agent.load_checkpoint(tmp_path / "ck")
    assert agent.fitness == report["fitness"][0] and agent.steps == 2
    named = dict(agent._activate().learner.named_params)
    for name, total in report["adapters"][0].items():
        assert float(named[name].detach().double().abs().sum()) == pytest.approx(total, rel=1e-6)


@pytest.mark.integration
def test_example_population_learns(tmp_path):
    """The library example, 2 generations: held-out reward from the untrained 0.17 to above 0.4
    for the mean of 4 members (the best member of the quickstart campaign reaches 0.51)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "library_grpo.py"),
            "--generations",
            "2",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["initial"] < 0.25
    assert summary["final_mean"] > summary["initial"] + 0.2
    assert (tmp_path / "run" / "best" / "attributes.pt").exists()


def test_train_population_logs_to_mlflow(straight):
    from mlflow import MlflowClient

    _, out = straight
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name.startswith("population")]
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"run", *(f"g00{g}-m0{i}" for g in (0, 1) for i in range(3))}
    parent = runs.pop("run")
    assert parent.data.params["algorithm.group_size"] == "4"
    assert parent.data.params["seed"] == "0"
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "best_fitness")] == [
        2,
        4,
    ]
    for name, run in runs.items():
        assert run.info.status == "FINISHED", name
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["member"] == name
        history = client.get_metric_history(run.info.run_id, "reward_mean")
        fitness = client.get_metric_history(run.info.run_id, "fitness")
        lr = client.get_metric_history(run.info.run_id, "lr")
        if name.startswith("g000"):
            assert [m.step for m in history] == [1, 2] and [m.step for m in fitness] == [2]
        else:
            assert run.data.tags["parent_member"].startswith("g000-m0")
            assert run.data.tags["mutation"]
            assert [m.step for m in history] == [3, 4] and [m.step for m in fitness] == [4]
        assert lr and all(m.value > 0 for m in lr)


def test_every_algorithm_has_a_population_constructor():
    from pbt import DPO, REINFORCE, SFT

    for cls, init_hp in ((REINFORCE, {"baseline": "rloo"}), (SFT, {}), (DPO, {"beta": 0.2})):
        config = {"algorithm": init_hp} if init_hp else None
        pop = cls.population(
            2, lr=1e-3, config=config, hp_config={"lr": {"min": 1e-5, "max": 1e-2}}
        )
        assert pop.manifest.algorithm.name == cls.name and len(pop) == 2
        assert set(pop[0].hyperparameters) == set(cls.mutable())
        assert pop[0].hyperparameters["lr"] == 1e-3


def test_get_actions_gives_each_agent_its_own_completions(tmp_path):
    """Several agents' prompts in one call (one engine batch under vLLM, see test_vllm.py):
    each agent gets what its own ``get_action`` gives."""
    pop = _population(tmp_path, optim={"lr": 5e-2})
    pop[1].train_step()  # the two adapters now differ
    prompts = [ex.question for ex in pop[0].sample_prompts()]
    together = pop.get_actions({agent: prompts for agent in pop}, training=False)
    for agent in pop:
        alone = agent.get_action(prompts, training=False)
        assert torch.equal(together[agent].completion_ids, alone.completion_ids)
    assert together[pop[0]].texts != together[pop[1]].texts
