"""AgileRL's configs load as AgileRL means them: fixtures reproduce their published LLM configs
and tutorial constants (each cites its file and commit); each mapped key lands in the config
that uses it, each key without an effect here gives its one line, and the table of docs/agilerl.md
is the code's table. Every fixture, shrunk in its own layout, passes ``pbt check`` and runs a campaign
of 2 members x 2 generations with ``pbt run``; members get the manifest translated once, in
canonical form, which reads back to the same manifest."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from support import FAKE, REPO, TESTS, decisions

from pbt.cli.main import main as pbt_main
from pbt.config import (
    MUTABLE_BY_ALGORITHM,
    SECTIONS,
    ConfigError,
    RewardRef,
    load_manifest,
    manifest_from_dict,
)
from pbt.config.agilerl import mapping_rows, translate_agilerl
from pbt.config.read.canonical import canonical_sections, manifest_from_canonical
from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore

FIXTURES = TESTS / "fixtures" / "agilerl"
FIXTURE_PATHS = sorted(FIXTURES.glob("*.yaml"))
AGILERL_PAGE = REPO / "docs" / "agilerl.md"
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
    from pbt.algorithms.data.rewards import build_reward
    from pbt.algorithms.data.tasks import Example

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
    assert any(p.startswith("launch.rollout_gpus_per_member (2) gives each of the member's 4")
               for p in problems)  # fmt: skip
    assert any(p.startswith("distributed.fsdp shards the adapter") for p in problems)
    arena["training"]["rollout_mode"] = "overlapped"
    with pytest.raises(ConfigError, match=r"training.rollout_mode \('overlapped'\) must be one"):
        manifest_from_dict(arena)


def test_arena_dedicated_async_engines() -> None:
    arena = {
        "algorithm": {"name": "GRPO"},
        "training": {"rollout_engines_per_agent": 1, "rollout_mode": "async"},
        "rollout": {"max_staleness": 2},
    }
    m = manifest_from_dict(arena)
    assert m.launch.rollout_gpus_per_member == 1 and m.rollout.mode == "async"
    assert m.rollout.max_staleness == 2
    arena["training"]["rollout_engines_per_agent"] = 0
    with pytest.raises(ConfigError, match=r"rollout.mode \(async\) samples on dedicated"):
        manifest_from_dict(arena)


def test_arena_auto_engines_and_the_version_lag_in_optimizer_steps() -> None:
    arena = {
        "algorithm": {"name": "GRPO", "update_epochs": 2},
        "training": {"rollout_engines_per_agent": "auto", "rollout_mode": "async"},
        "replay_buffer": {"kind": "llm", "max_rollout_version_lag": 3, "max_size": 64},
    }
    m = manifest_from_dict(arena)
    assert m.launch.rollout_gpus_per_member == "auto"
    assert m.rollout.max_staleness == 6  # 3 learning steps of 2 optimizer steps each
    assert any(n.startswith("replay_buffer.max_size (64): ") for n in m.notes())
    del arena["algorithm"]["update_epochs"]
    assert manifest_from_dict(arena).rollout.max_staleness == 3
    arena["training"]["rollout_mode"] = "colocated"  # auto without async: no engine
    arena["replay_buffer"] = {"kind": "llm"}
    assert manifest_from_dict(arena).launch.rollout_gpus_per_member == "auto"
    bad = {
        "algorithm": {"name": "GRPO"},
        "training": {"rollout_engines_per_agent": "many", "weight_sync_interval": 2},
        "replay_buffer": {"kind": "classic", "max_rollout_version_lag": -1, "sizee": 1},
    }
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(bad)
    problems = err.value.problems
    for start in (
        "training.rollout_engines_per_agent ('many') must be a whole number >= 0",
        "training.weight_sync_interval (2) would let the engines lag",
        "replay_buffer.kind ('classic') is AgileRL's buffer for off-policy agents",
        "replay_buffer.max_rollout_version_lag (-1) must be a whole number >= 0",
        "replay_buffer.sizee is not a known key; known: kind, max_rollout_version_lag",
    ):
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert all("\n" not in p for p in problems)


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


def test_the_docs_table_is_the_codes_table() -> None:
    text = AGILERL_PAGE.read_text()
    section = text.split("## Coming from AgileRL", 1)[1].split("\n## ", 1)[0]
    rows = [
        tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    assert rows == mapping_rows()
    assert not re.search(r"AgileRL's[^.]*`TOURNAMENT_SIZE`", text)


# -- one canonical manifest crosses the process boundary ----------------------------------------


def _loadable(path: Path) -> dict:
    """A fixture's sections with vLLM off where it asks for it (vLLM is not installed here)."""
    data = yaml.safe_load(path.read_text())
    if "USE_VLLM" in data.get("INIT_HP", {}):
        data["INIT_HP"]["USE_VLLM"] = False
    if "use_vllm" in data.get("algorithm", {}):
        data["algorithm"]["use_vllm"] = False
    return data


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.yaml")), ids=lambda p: p.stem)
def test_the_canonical_form_reads_back_to_the_same_manifest(path: Path) -> None:
    """Every field compares equal (``translation_notes`` is not a setting and is not compared);
    through JSON (a task) and YAML (``pbt check --resolved``) alike."""
    manifest = manifest_from_dict(_loadable(path), base_dir=FIXTURES)
    sections = canonical_sections(manifest)
    assert list(sections) == list(SECTIONS)
    for text, parse in (
        (json.dumps(sections), json.loads),
        (yaml.safe_dump(sections), yaml.safe_load),
    ):
        back = manifest_from_canonical(parse(text), base_dir=FIXTURES)
        assert back == manifest and canonical_sections(back) == sections
        assert back.translation_notes == []  # translated once, before: nothing to say again


def test_a_copy_with_sorted_keys_means_the_same() -> None:
    """A campaign's store keeps the sections as JSON with sorted keys, from which resume
    rebuilds the manifest: AgileRL's prompt turns keep the order of their indices."""
    data = yaml.safe_load((FIXTURES / "grpo.yaml").read_text())
    copy_sorted = json.loads(json.dumps(data, sort_keys=True))
    assert next(iter(copy_sorted["environment"]["prompt_template"])) == "assistant_2"
    resumed = manifest_from_dict(copy_sorted, base_dir=FIXTURES)
    assert resumed == manifest_from_dict(data, base_dir=FIXTURES)
    assert resumed.task.assistant_prefill == "Let me solve this step by step.\n<redacted_thinking>"


def test_a_member_refuses_a_manifest_that_was_never_translated() -> None:
    """The mixture members were once handed (AgileRL's sections plus our training section) is
    refused in one line, instead of a second translation's misleading problems."""
    mixture = yaml.safe_load((FIXTURES / "grpo.yaml").read_text())
    mixture["training"] |= {"steps": 4, "activation_checkpointing": False}
    with pytest.raises(ConfigError) as err:
        manifest_from_canonical(mixture, base_dir=FIXTURES)
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(
        "not a canonical manifest: environment, selection_strategy, network are not our sections"
    )
    agilerl_keys = {"training": {"max_steps": 4}}
    with pytest.raises(ConfigError, match=r"algorithm, training or mutation holds AgileRL's keys"):
        manifest_from_canonical(agilerl_keys, base_dir=FIXTURES)
    upper = {"INIT_HP": {"LR": 1e-5}}
    with pytest.raises(ConfigError, match=r"not a canonical manifest: INIT_HP is not"):
        manifest_from_canonical(upper, base_dir=FIXTURES)


SMALL_INIT_HP = {"POP_SIZE": 2, "BATCH_SIZE": 2, "MAX_OUTPUT_TOKENS": 4, "EVO_STEPS": 1}
SMALL_ALGORITHM = {"batch_size": 2, "max_output_tokens": 4}
SMALL_TRAINING = {"pop_size": 2, "evo_steps": 1, "max_steps": 4}
LOCAL_ROWS = {"GRPO": "countdown.jsonl", "DPO": "prefs.jsonl", "SFT": "prefs.jsonl"}
FAST = {"launch": {"slots": 1, "persistent_workers": True}, "tracking": {"enabled": False}}
"""One long-lived worker per campaign serves its four tasks (the cheapest shape measured)."""


def _small_campaign(path: Path, folder: Path) -> Path:
    """The fixture in its own layout (its own keys, in its own spelling), shrunk to 2 members
    x 2 generations of one step on the tiny model: population, batch, group and completion
    length set smaller, the model and any hub rows pointed at local ones, vLLM off, an
    environment's held-out seeds fewer; plus our ``launch`` and ``tracking`` sections, which AgileRL's format lacks, for speed."""
    data = _loadable(path)
    if "INIT_HP" in data:
        data["INIT_HP"] |= SMALL_INIT_HP | (
            {"GROUP_SIZE": 2} if "GROUP_SIZE" in data["INIT_HP"] else {}
        )
        data |= {"model": {"name": "builtin:tiny"}, "task": {"name": "builtin:letters", "eval_size": 2},
                 "budget": {"generations": 2}}  # fmt: skip
    else:
        data["algorithm"] |= SMALL_ALGORITHM
        data["training"] |= SMALL_TRAINING
        data["network"]["pretrained_model_name_or_path"] = "builtin:tiny"
        if "dataset" in data["environment"]:
            data["environment"]["dataset"] = LOCAL_ROWS[data["algorithm"]["name"]]
        else:  # a multi-turn environment: fewer held-out seeds
            data["task"] = {"eval_size": 2}
    for name in ("reward.py", *set(LOCAL_ROWS.values())):
        shutil.copy(FIXTURES / name, folder / name)
    out = folder / path.name
    out.write_text(yaml.safe_dump(data | FAST, sort_keys=False))
    return out


CONCURRENT = 3
"""Campaigns run at once. Each is mostly process start-up (a controller, a torchrun agent, a
worker importing torch and transformers, the tiny model) and a few seconds of training: one
long-lived worker per campaign took 16.6 s of CPU for grpo_lora's, a process per task 60 s. On
two cores shared with other work (load ~10), the ten took 8.7 minutes one after another and
4.1 minutes three at a time (3.5 CPU-minutes in all)."""


def _pbt_run(manifest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pbt.cli", "run", str(manifest), "--dir", str(manifest.parent / "c")],
        capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def fixture_campaigns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Every fixture's small campaign run by ``pbt run``, :data:`CONCURRENT` at a time: its
    manifest and finished process, by fixture name."""
    root = tmp_path_factory.mktemp("agilerl-campaigns")
    manifests = []
    for path in FIXTURE_PATHS:
        (root / path.stem).mkdir()
        manifests.append(_small_campaign(path, root / path.stem))
    with ThreadPoolExecutor(CONCURRENT) as pool:
        runs = list(pool.map(_pbt_run, manifests))
    return {m.parent.name: (m, run) for m, run in zip(manifests, runs, strict=True)}


@pytest.mark.integration
@pytest.mark.parametrize("path", FIXTURE_PATHS, ids=lambda p: p.stem)
def test_each_fixture_checks_and_runs_a_2x2_campaign(path: Path, fixture_campaigns, capsys) -> None:
    """``pbt check`` passes and ``pbt run`` ends: four members trained, each handed the
    controller's canonical manifest, which reads back to the checked manifest but for the
    members' schedule (``training.steps``: the campaign's, not one generation's)."""
    manifest_path, run = fixture_campaigns[path.stem]
    assert pbt_main(["check", str(manifest_path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == f"{manifest_path}: valid", err
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    directory = manifest_path.parent / "c"
    with CampaignStore(directory / "store.db") as store:
        members = store.members()
    assert len(members) == 4 and {m.generation for m in members} == {0, 1}
    assert all(m.status == "done" and len(m.fitness_history) >= 1 for m in members), members
    checked = load_manifest(manifest_path)
    steps = checked.budget.generations * checked.population.evo_steps  # the whole campaign
    want = dataclasses.replace(checked, training=dataclasses.replace(checked.training, steps=steps))
    for task in directory.glob("tasks/*/task.json"):
        handed = json.loads(task.read_text())
        assert list(handed["manifest"]) == list(SECTIONS)
        assert manifest_from_canonical(handed["manifest"], handed["manifest_base_dir"]) == want


def _finish(campaign: Campaign) -> int:
    campaign.say = lambda *_: None
    try:
        return campaign.run().generations
    finally:
        campaign.close()


@pytest.mark.integration
def test_an_agilerl_campaign_resumes_with_a_raised_budget_as_if_planned(tmp_path: Path) -> None:
    """Resume rebuilds the manifest from the store's sections as written (AgileRL's lowercase
    ones, translated again by the resuming controller); ``--total-steps`` replaces their
    ``training.max_steps``, the members are handed the canonical manifest with the new budget,
    and the decisions are those of a campaign planned with it (fake members: the controller is
    under test)."""
    small = _small_campaign(FIXTURES / "grpo.yaml", tmp_path)
    planned = yaml.safe_load(small.read_text())
    planned["training"]["max_steps"] = 6
    (tmp_path / "planned.yaml").write_text(yaml.safe_dump(planned, sort_keys=False))
    assert _finish(Campaign.start(tmp_path / "planned.yaml", tmp_path / "p", FAKE)) == 3
    assert _finish(Campaign.start(small, tmp_path / "c", FAKE)) == 2
    resumed = Campaign.resume(tmp_path / "c", FAKE, budget={"total_steps": 6})
    assert _finish(resumed) == 3
    assert decisions(tmp_path / "c") == decisions(tmp_path / "p")
    with CampaignStore(tmp_path / "c" / "store.db") as store:
        kept = store.load_config()["manifest"]
    assert {"network", "environment", "selection_strategy"} <= set(kept)  # as written
    assert "max_steps" not in kept["training"] and kept["budget"] == {"total_steps": 6}
    task = json.loads((tmp_path / "c" / "tasks" / "g002-m00" / "task.json").read_text())
    handed = manifest_from_canonical(task["manifest"], task["manifest_base_dir"])
    assert handed.budget.total_steps == 6 and handed.training.steps == 3  # 3 generations x 1
