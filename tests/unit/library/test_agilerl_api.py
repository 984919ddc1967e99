"""AgileRL's Python API over library mode: the algorithm names, pbt.hpo, create_population's
AgileRL call shape, RLParameter/HyperparameterConfig and finetune_llm."""

from __future__ import annotations

import random
import subprocess
import sys
import warnings

import pytest
from support import small_sections

from pbt import create_population
from pbt.agilerl.finetune import finetune_llm
from pbt.config.errors import ConfigError
from pbt.config.ranges import HPRange
from pbt.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection

MUTATION_PARAMS = {"NO_MUT": 0.1, "RL_HP_MUT": 0.6, "MUT_SD": 0.1, "RAND_SEED": 42}


def _agilerl_mutations(**overrides) -> Mutations:
    """Mutations made exactly as AgileRL's GRPO HPO tutorial makes them."""
    kwargs = dict(
        no_mutation=MUTATION_PARAMS["NO_MUT"],
        architecture=0,
        new_layer_prob=0,
        parameters=0,
        activation=0,
        rl_hp=MUTATION_PARAMS["RL_HP_MUT"],
        mutation_sd=MUTATION_PARAMS["MUT_SD"],
        rand_seed=MUTATION_PARAMS["RAND_SEED"],
    )
    return Mutations(**(kwargs | overrides))


def test_imports_load_no_torch():
    code = (
        "import sys\n"
        "from pbt.algorithms import GRPO, CISPO, GSPO, LLMPPO, LLMReinforce, LLMREINFORCE, SFT, DPO\n"
        "from pbt.hpo import TournamentSelection, Mutations, RLParameter, HyperparameterConfig\n"
        "import pbt\n"
        "assert pbt.CISPO is CISPO and LLMREINFORCE is LLMReinforce\n"
        "pop = GSPO.population(2, model_name='builtin:tiny')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(CISPO.name, CISPO.loss, pop.manifest.algorithm.loss, LLMPPO.name, "
        "LLMReinforce.name, SFT.name, DPO.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["GRPO", "cispo", "gspo", "PPO", "REINFORCE", "SFT", "DPO"]


def test_cispo_refuses_another_loss():
    from pbt.algorithms import CISPO

    with pytest.raises(ConfigError, match=r"algorithm.loss \('dapo'\) contradicts CISPO"):
        CISPO.population(2, config={"algorithm": {"loss": "dapo"}})


def test_create_population_takes_agilerl_call_shape():
    hp_config = HyperparameterConfig(
        lr=RLParameter(min=1e-6, max=1e-2), beta=RLParameter(min=1e-4, max=0.1)
    )
    init_hp = {"ALGO": "GRPO", "LR": 1e-3, "BETA": 0.01, "GROUP_SIZE": 4, "POP_SIZE": 4}
    pop = create_population(
        "GRPO",
        None,
        init_hp,
        hp_config=hp_config,
        population_size=3,
        model_name="builtin:tiny",
        lora_config={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj"]},
        algo_kwargs={"temperature": 0.7},
    )
    manifest = pop.manifest
    assert len(pop) == 3 and manifest.algorithm.group_size == 4
    assert (manifest.lora.r, manifest.lora.alpha, manifest.lora.target_modules) == (
        4,
        8,
        ["q_proj"],
    )
    assert manifest.rollout.temperature == 0.7
    assert manifest.mutation.ranges["lr"] == {
        "min": 1e-6, "max": 1e-2, "grow_factor": 1.2, "shrink_factor": 0.8, "dtype": "float"
    }  # fmt: skip
    assert len(create_population("GRPO", None, init_hp)) == 4  # POP_SIZE
    with pytest.raises(ConfigError) as err:
        create_population("GRPO", {"latent_dim": 64}, init_hp, actor_network=object())
    text = str(err.value)
    assert "create_population(net_config={'latent_dim': 64}) is not supported" in text
    assert "create_population(actor_network=<object object" in text and "pass model_name" in text
    with pytest.warns(UserWarning, match=r"accelerator=...\) has no effect"):
        create_population("GRPO", None, init_hp, accelerator=object())
    with pytest.raises(ConfigError, match="has no argument 'net_confg'"):
        create_population("GRPO", net_confg=None, INIT_HP=init_hp)


def test_population_takes_agilerl_arguments():
    from pbt.algorithms import GRPO

    pop = GRPO.population(
        size=2,
        hp_config=HyperparameterConfig(temperature=RLParameter(min=0.5, max=1.5)),
        model_name="builtin:tiny",
        use_vllm=False,
        lora_config={"r": 4, "lora_alpha": 16, "bias": "none"},
        lr=1e-3,
    )
    assert pop.manifest.rollout.engine == "hf" and pop.manifest.lora.r == 4
    assert set(pop.manifest.mutation.ranges) == {"temperature"}
    with pytest.raises(ConfigError, match=r"dtype \(<class 'list'>\) must be float or int"):
        GRPO.population(2, hp_config={"lr": RLParameter(min=0.1, max=1, dtype=list)})
    with pytest.raises(ConfigError, match="must be an RLParameter"):
        HyperparameterConfig(lr={"min": 0.1, "max": 1})


def test_mutations_refuse_what_an_adapter_cannot_do_and_warn_on_the_harmless():
    with pytest.raises(ConfigError) as err:
        _agilerl_mutations(architecture=0.2, parameters=0.1, activation=0.1)
    text = str(err.value)
    for key in ("architecture=0.2", "parameters=0.1", "activation=0.1"):
        assert f"Mutations({key}) must be 0" in text
    with pytest.warns(UserWarning, match=r"new_layer_prob=0.2\) has no effect"):
        _agilerl_mutations(new_layer_prob=0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mutations = _agilerl_mutations()  # the tutorial's own values: silent
    assert mutations.mutate_elite is True  # AgileRL's default
    with pytest.raises(ConfigError, match=r"rl_hp \(1.5\) must be a probability"):
        Mutations(rl_hp=1.5)


def test_tournament_takes_eval_loop_as_the_fitness_window():
    assert TournamentSelection(2, True, 4, eval_loop=3).fitness_window == 3
    assert TournamentSelection(2, True, 4).fitness_window == 1
    with pytest.raises(ConfigError, match="name the same setting"):
        TournamentSelection(2, True, 4, eval_loop=2, fitness_window=3)
    with pytest.raises(ConfigError, match=r"tournament_size \(5\) must be <="):
        TournamentSelection(tournament_size=5, elitism=True, population_size=4)


def test_select_returns_elite_and_population_and_mutation_moves_one_hp():
    init_hp = {"LR": 1e-3, "BETA": 0.01}
    pop = create_population(
        "GRPO", None, init_hp, population_size=3, hp_config={"lr": {"min": 1e-5, "max": 1e-1}}
    )
    for agent, fitness in zip(pop, [0.2, 0.9, 0.1], strict=True):
        agent.fitness.append(fitness)
    best = pop[1].member_id
    elite, pop = TournamentSelection(2, True, 3).select(pop)
    assert elite is pop[0] and elite.parent_id == best and pop.generation == 1
    pop = _agilerl_mutations(no_mutation=0.0, rl_hp=1.0, mutate_elite=False).mutation(pop)
    assert pop[0].mutation == "none (elite)"
    for agent in pop[1:]:
        assert agent.mutation.startswith("lr x") and agent.hyperparameters["lr"] != 1e-3
        assert agent.hyperparameters["beta"] == 0.01
    with pytest.raises(ConfigError, match=r"rl_hp_selection=\['group_size'\]\) names"):
        Mutations(rl_hp=1.0, rl_hp_selection=["group_size"]).mutation(pop)
    # the records form of our own spelling is unchanged
    chosen = TournamentSelection(2, True, 3).select(pop.records(), random.Random(0))
    assert len(chosen) == 3 and chosen[0].is_elite
    ranges = {"beta": HPRange(min=1e-3, max=1.0)}
    pop = Mutations(no_mutation=0, rl_hp=1.0, ranges=ranges, rand_seed=1).mutation(pop)
    assert all(a.mutation.startswith("beta") for a in pop)  # the elite too: mutate_elite=True


@pytest.mark.integration
def test_agilerl_style_loop_runs_two_evolutions(tmp_path):
    init_hp = {"ALGO": "GRPO", "LR": 5e-3, "BETA": 0.01, "GROUP_SIZE": 2, "POP_SIZE": 2}
    sections = small_sections(tmp_path, rollout={"max_output_tokens": 4}, task={"eval_size": 2})
    sections["algorithm"] = {"prompts_per_step": 2}  # GROUP_SIZE comes from INIT_HP
    pop = create_population(
        "GRPO",
        None,
        init_hp,
        hp_config=HyperparameterConfig(lr=RLParameter(min=1e-4, max=1e-1)),
        population_size=init_hp["POP_SIZE"],
        config=sections,
    )
    tournament = TournamentSelection(
        tournament_size=2, elitism=True, population_size=init_hp["POP_SIZE"], eval_loop=1
    )
    mutations = _agilerl_mutations(no_mutation=0.0, rl_hp=1.0)
    with pytest.warns(UserWarning, match="max_reward"):
        pop, fitnesses = finetune_llm(
            pop,
            init_hp=init_hp,
            evo_steps=1,
            evaluation_interval=1,
            max_steps=3 * 2 * 2,  # prompts in all: 3 steps x 2 prompts x 2 members
            tournament=tournament,
            mutation=mutations,
            max_reward=1.0,
            save_elite=True,
            elite_path=tmp_path / "elite",
            checkpoint_path=tmp_path / "run",
            tracking=False,
            verbose=False,
        )
    assert pop.generation == 2 and len(pop) == 2 and len(fitnesses) == 2
    assert all(a.steps == 3 and len(a.fitness) == 3 for a in pop)
    assert all(a.mutation.startswith("lr ") for a in pop)  # rl_hp=1, the elite mutates too
    assert (tmp_path / "elite" / "attributes.pt").is_file()
    assert (tmp_path / "elite" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "run" / "population.json").is_file()
