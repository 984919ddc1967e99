"""AgileRL's configs load as AgileRL means them: fixtures reproduce their published LLM configs
and tutorial constants (each cites its file and commit); each mapped key lands in the config
that uses it, each key without an effect here gives its one line, and the README's table is the
code's table."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from pbt.config import (
    MUTABLE_BY_ALGORITHM,
    ConfigError,
    RewardRef,
    load_manifest,
    manifest_from_dict,
)
from pbt.config.agilerl import mapping_rows, translate_agilerl

FIXTURES = Path(__file__).parent / "fixtures" / "agilerl"
README = Path(__file__).parents[1] / "README.md"
GROUP_SIZE_MUTABLE = "group_size" in MUTABLE_BY_ALGORITHM["GRPO"]


def _known_gaps(data: dict) -> list[str]:
    """What pbt-llm refuses in a published config, with its reason: (until group_size mutates)
    a group-size range; and where vLLM is not installed, a vLLM rollout."""
    gaps = []
    if "MIN_GROUP_SIZE" in data.get("MUTATION_PARAMS", {}) and not GROUP_SIZE_MUTABLE:
        gaps.append("mutation.ranges.group_size is not a mutable hyperparameter")
    wants_vllm = data.get("INIT_HP", {}).get("USE_VLLM") or data.get("algorithm", {}).get(
        "use_vllm"
    )
    if wants_vllm and importlib.util.find_spec("vllm") is None:
        gaps.append("rollout.engine is 'vllm' but vLLM is not installed")
    return gaps


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_published_config_passes_check_but_for_its_known_gaps(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    assert "commit " in path.read_text().splitlines()[1], "fixture must cite its commit"
    gaps = _known_gaps(data)
    if not gaps:
        load_manifest(path)
        return
    with pytest.raises(ConfigError) as err:
        load_manifest(path)
    assert len(err.value.problems) == len(gaps), err.value.problems
    for gap, problem in zip(gaps, err.value.problems, strict=True):
        assert problem.startswith(gap), problem


def test_a_tournament_larger_than_a_population_of_one_is_cut_to_it_with_a_note() -> None:
    manifest = manifest_from_dict({"INIT_HP": {"POP_SIZE": 1, "TOURN_SIZE": 2}})
    assert manifest.population.size == 1 and manifest.population.tournament_size == 1
    assert any(
        n.startswith("INIT_HP.TOURN_SIZE (2): a tournament cannot hold") for n in manifest.notes()
    )


def _fixture(name: str, **init_hp: object) -> dict:
    data = yaml.safe_load((FIXTURES / name).read_text())
    data.get("INIT_HP", {}).update(init_hp)
    if not GROUP_SIZE_MUTABLE:  # the group-size range is checked in the test above
        for key in ("MIN_GROUP_SIZE", "MAX_GROUP_SIZE"):
            data.get("MUTATION_PARAMS", {}).pop(key, None)
    return data


def test_the_tutorial_constants_land_where_they_act() -> None:
    manifest = manifest_from_dict(_fixture("grpo_reasoning_hpo.yaml"))
    alg, pop, mut = manifest.algorithm, manifest.population, manifest.mutation
    assert alg.prompts_per_step == 16 and alg.micro_batch_size is None  # BATCH_SIZE: prompts
    assert alg.batch_completions == 16 * 8 and alg.group_size == 8
    assert alg.beta == 0.001 and alg.clip_low == alg.clip_high == 0.2 and alg.update_epochs == 1
    assert manifest.optim.lr == 5e-6 and manifest.optim.max_grad_norm == 0.1
    assert manifest.rollout.temperature == 0.9 and manifest.rollout.vllm.max_model_len == 1024
    assert (pop.size, pop.tournament_size, pop.elitism, pop.fitness_window) == (4, 2, True, 1)
    assert (mut.no_mutation, mut.rl_hp, manifest.training.seed) == (0.1, 0.6, 42)
    assert mut.ranges["lr"] == {"min": 1e-7, "max": 1e-5}
    assert mut.ranges["beta"] == {"min": 1e-4, "max": 0.01}
    notes = manifest.notes()
    assert any(n.startswith("MUTATION_PARAMS.MUT_SD (0.1): ") for n in notes)
    assert any(n.startswith("INIT_HP.MAX_MODEL_LEN (1024) sets rollout.vllm") for n in notes)


def test_group_size_bounds_become_an_integer_range() -> None:
    data = yaml.safe_load((FIXTURES / "grpo_reasoning_hpo.yaml").read_text())
    translate_agilerl(data)
    assert data["mutation"]["ranges"]["group_size"] == {"min": 4, "max": 12, "dtype": "int"}


def test_the_training_config_lora_schedule_and_notes() -> None:
    manifest = manifest_from_dict(_fixture("grpo_training.yaml", POP_SIZE=2))
    assert manifest.rollout.min_output_tokens == 0 and manifest.rollout.max_output_tokens == 300
    assert manifest.optim.schedule == "constant" and manifest.rollout.engine == "hf"
    assert manifest.algorithm.prompts_per_step == 4 and manifest.algorithm.group_size == 2
    notes = manifest.notes()
    for key in ("REDUCE_MEMORY_PEAK", "CALC_POSITION_EMBEDDINGS"):
        assert sum(n.startswith(f"INIT_HP.{key} (True): ") for n in notes) == 1, notes
    lora = manifest_from_dict(_fixture("grpo_lora.yaml", POP_SIZE=2)).lora
    assert (lora.r, lora.alpha, lora.dropout) == (16, 64.0, 0.05)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


def _notes_once(notes: list[str], *origins: str) -> None:
    for origin in origins:
        assert sum(n.startswith(origin) for n in notes) == 1, (origin, notes)


def test_gspo_and_cispo_land_their_advantage_and_kl_keys() -> None:
    gspo = manifest_from_dict(_fixture("gspo.yaml", USE_VLLM=False))
    alg = gspo.algorithm
    assert (alg.name, alg.loss, alg.advantage_norm, alg.kl_in_advantage) == (
        "GRPO", "gspo", "mean_only", True)  # fmt: skip
    assert (alg.beta, alg.prompts_per_step, alg.group_size, alg.micro_batch_size) == (
        0.001, 4, 16, 4)  # fmt: skip
    assert gspo.rollout.max_output_tokens == 64 and gspo.rollout.vllm.max_model_len == 1024
    assert (gspo.lora.r, gspo.lora.alpha, gspo.lora.dropout) == (16, 64.0, 0.05)
    assert gspo.mutation.ranges["group_size"] == {"min": 4, "max": 12, "dtype": "int"}
    _notes_once(gspo.notes(), "INIT_HP.USE_MEMORY_EFFICIENT_PARAMS (True): ")
    data = yaml.safe_load((FIXTURES / "gspo.yaml").read_text())
    translate_agilerl(data)
    assert data["rollout"]["engine"] == "vllm"  # USE_VLLM: true, as published

    cispo = manifest_from_dict(_fixture("cispo.yaml", USE_VLLM=False))
    alg = cispo.algorithm
    assert (alg.loss, alg.advantage_norm, alg.kl_in_advantage, alg.beta) == (
        "cispo", "mean_std", False, 0.0)  # fmt: skip
    assert (alg.clip_low, alg.clip_high, alg.prompts_per_step) == (0.4, 0.4, 16)
    _notes_once(
        cispo.notes(), "INIT_HP.FILTER_ZERO_ADV (False): ", "INIT_HP.USE_LIGER_LOSS (False): ",
        "INIT_HP.USE_MEMORY_EFFICIENT_PARAMS (True): ",
    )  # fmt: skip


def test_the_rubric_config_lands_its_reward_prefill_and_notes() -> None:
    m = load_manifest(FIXTURES / "grpo_rubric.yaml")
    task, alg = m.task, m.algorithm
    assert task.reward == RewardRef(file="reward.py", function="RUBRIC")
    assert task.assistant_prefill == "Let me solve this step by step.\n<redacted_thinking>"
    assert task.prompt_template.startswith("Using each number in this list only once {nums}")
    assert task.system_prompt.startswith("You are a helpful assistant.")
    assert (task.question_field, task.answer_field) == ("nums", "target")
    assert task.train == "hf:Jiayi-Pan/Countdown-Tasks-3to4"
    assert task.eval_fraction == pytest.approx(0.2)
    assert (alg.prompts_per_step, alg.group_size, m.population.size) == (6, 2, 2)
    _notes_once(m.notes(), "environment.rubric_name ('RUBRIC'): ", "environment.max_reward (2.0): ")
    from pbt.algorithms.rewards import build_reward
    from pbt.algorithms.tasks import Example

    reward = build_reward(task, FIXTURES, None)
    rows = [Example([3, 5, 2], 13)] * 3
    texts = ["x", "<answer>3 + 5</answer>", "</think>\n<answer>(3 * 5) - 2</answer>"]
    total, _ = reward(rows, texts)
    assert total.tolist() == [0.0, 1.0, 2.0] and reward.names == ["RUBRIC"]


def test_reward_and_rubric_keys_are_one_key_as_in_agilerl() -> None:
    data = {"environment": {"rubric_file_path": "r.py", "reward_fn_name": "fn"}}
    translation = translate_agilerl(data)
    assert data["task"]["reward"] == {"file": "r.py", "function": "fn"}
    assert not translation.problems and not translation.notes  # no rubric_name: no rubric note
    both = {"environment": {"rubric_file_path": "r.py", "reward_file_path": "s.py",
                            "reward_fn_name": "fn"}}  # fmt: skip
    assert translate_agilerl(both).problems == [
        "environment.rubric_file_path and environment.reward_file_path are one key in AgileRL; "
        "give one of them"
    ]


def test_llmppo_maps_onto_ppo() -> None:
    alg = manifest_from_dict(_fixture("ppo_llm.yaml")).algorithm
    assert (alg.name, alg.gamma, alg.vf_coef, alg.lam, alg.prompts_per_step) == (
        "PPO", 0.99, 0.5, 1.0, 1)  # fmt: skip


def test_the_lowercase_format_lands_in_our_sections() -> None:
    m = load_manifest(FIXTURES / "dpo.yaml")
    assert (m.algorithm.name, m.algorithm.prompts_per_step, m.algorithm.beta) == ("DPO", 16, 0.001)
    assert m.task.train == "hf:HumanLLMs/Human-Like-DPO-Dataset"
    assert (m.budget.total_steps, m.population.evo_steps, m.population.size) == (100000, 10, 4)
    assert m.training.eval_every == 5 and m.population.tournament_size == 2
    assert m.model.name == "Qwen/Qwen2.5-0.5B" and (m.lora.r, m.lora.alpha) == (16, 64.0)
    assert set(m.mutation.ranges) == {"lr", "beta"} and m.mutation.no_mutation == 0.1
    notes = m.notes()
    for origin in ("algorithm.use_separate_reference_adapter", "training.num_epochs",
                   "mutation.mutation_sd", "network.max_context_length"):  # fmt: skip
        assert sum(n.startswith(origin) for n in notes) == 1, (origin, notes)
    assert load_manifest(FIXTURES / "sft.yaml").task.response_field == "chosen"


def test_the_environment_becomes_the_task(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"nums": [1, 2], "target": 3}\n')
    (tmp_path / "reward.py").write_text(
        "def reward_fn(completion, answer, question):\n    return 0.0\n"
    )
    data = {
        "algorithm": {"name": "GRPO", "batch_size": 2, "group_size": 2},
        "environment": {
            "dataset": "rows.jsonl",
            "columns": {"nums": "question", "target": "answer"},
            "reward_file_path": "reward.py",
            "reward_fn_name": "reward_fn",
            "prompt_template": {
                "system_0": "Be brief.",
                "user_1": "Use {question} to make {answer}.",
            },
            "max_reward": 2.0,
            "train_test_split": 0.8,
        },
    }
    task = manifest_from_dict(data, base_dir=tmp_path).task
    assert (task.train, task.question_field, task.answer_field) == ("rows.jsonl", "nums", "target")
    assert (
        task.system_prompt == "Be brief." and task.prompt_template == "Use {nums} to make {target}."
    )
    assert task.reward is not None and (task.reward.file, task.reward.function) == (
        "reward.py",
        "reward_fn",
    )
    assert task.eval_fraction == pytest.approx(0.2)
    prefill = copy.deepcopy(data)
    prefill["environment"]["prompt_template"]["assistant_2"] = "Let me think.\n<think>"
    task = manifest_from_dict(prefill, base_dir=tmp_path).task
    assert task.assistant_prefill == "Let me think.\n<think>"
    assert task.prompt_template == "Use {nums} to make {target}."
    turns = prefill["environment"]["prompt_template"]
    prefill["environment"]["prompt_template"] = {"assistant_0": "Sure.", **turns}
    with pytest.raises(ConfigError, match=r"prompt_template.assistant_0 is refused: only a last"):
        manifest_from_dict(prefill, base_dir=tmp_path)
    prefill["environment"]["prompt_template"] = {**turns, "assistant_2": "For {answer}:"}
    with pytest.raises(ConfigError, match=r"assistant_2 is refused: task.assistant_prefill is lit"):
        manifest_from_dict(prefill, base_dir=tmp_path)


def test_the_arena_keys() -> None:
    arena = {
        "algorithm": {"name": "GRPO", "fsdp": True},
        "training": {"rollout_batch_size": 8, "training_gpus_per_agent": 4},
    }
    m = manifest_from_dict(arena)
    assert m.distributed.fsdp is True and m.launch.gpus_per_member == 4
    assert m.algorithm.prompts_per_step == 8
    arena["training"]["rollout_batch_size"] = 6
    arena["training"]["rollout_engines_per_agent"] = 2
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(arena)
    problems = err.value.problems
    assert any(
        "rollout_batch_size (6) must be a multiple of" in p and "use 4" in p for p in problems
    )
    assert any(p.startswith("training.rollout_engines_per_agent (2) is refused") and
               "rollout.engine: vllm" in p for p in problems)  # fmt: skip


@pytest.mark.parametrize(
    ("given", "start"),
    [
        ({"MUTATION_PARAMS": {"ARCH_MUT": 0.2}}, "MUTATION_PARAMS.ARCH_MUT (0.2) is refused"),
        ({"INIT_HP": {"FILTER_ZERO_ADV": True}}, "INIT_HP.FILTER_ZERO_ADV (True) is refused"),
        ({"INIT_HP": {"ADV_NORM": "mean"}}, "algorithm.advantage_norm ('mean') must be one of"),
        ({"INIT_HP": {"LORA": {"r": 8, "bias": "all"}}}, "INIT_HP.LORA ("),
        ({"MUTATION_PARAMS": {"MIN_LR": 1e-6}}, "MUTATION_PARAMS.MIN_/MAX_: lr has no max"),
        ({"INIT_HP": {"TOURN_SIZ": 2}}, "INIT_HP.TOURN_SIZ is not a known key; did you mean"),
    ],
)
def test_what_would_change_results_is_refused_in_one_line(given: dict, start: str) -> None:
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(given)
    assert len(err.value.problems) == 1 and err.value.problems[0].startswith(start), err.value


def test_advantage_normalisation_and_kl_shaping_map_onto_the_algorithm() -> None:
    upper = manifest_from_dict(
        {"INIT_HP": {"ALGO": "GSPO", "BETA": 0.001, "ADV_NORM": "mean_only",
                     "USE_KL_ADVANTAGE_SHAPING": True, "FILTER_ZERO_ADV": False}}
    )  # fmt: skip
    alg = upper.algorithm
    assert (alg.loss, alg.advantage_norm, alg.kl_in_advantage) == ("gspo", "mean_only", True)
    assert [n for n in upper.notes() if n.startswith("INIT_HP.FILTER_ZERO_ADV (False): ")]
    lower = manifest_from_dict(
        {"algorithm": {"name": "GRPO", "batch_size": 2, "adv_norm": "mean_std",
                       "use_kl_advantage_shaping": False}}
    )  # fmt: skip
    assert (lower.algorithm.advantage_norm, lower.algorithm.kl_in_advantage) == ("mean_std", False)


def test_zero_architecture_mutations_and_cispo_are_accepted() -> None:
    m = manifest_from_dict(
        {"INIT_HP": {"ALGO": "CISPO", "LOSS_TYPE": "cispo", "ADV_NORM": "mean_std"},
         "MUTATION_PARAMS": {"ARCH_MUT": 0, "NEW_LAYER": 0, "PARAMS_MUT": 0, "ACT_MUT": 0}}
    )  # fmt: skip
    assert (m.algorithm.name, m.algorithm.loss) == ("GRPO", "cispo") and m.notes() == []


def test_the_readme_table_is_the_codes_table() -> None:
    text = README.read_text()
    section = text.split("## Coming from AgileRL", 1)[1].split("\n## ", 1)[0]
    rows = [
        tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    assert rows == mapping_rows()
    assert not re.search(r"AgileRL's[^.]*`TOURNAMENT_SIZE`", text)
