"""The bad-input corpus: malformed manifests and ``INIT_HP`` dicts, each refused with one message
that names the key, the value and the fix; ``pbt check`` exits 2 with no traceback.

Each case is ``(sections, key, value, fix)``: the message must contain all three strings.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pbt.config.errors import ConfigError
from pbt.config.loader import manifest_from_dict
from pbt.library.create import create_population

OFFLOAD = {"cpu_offload": True, "optim_cpu_offload": False}

CASES: dict[str, tuple[dict, str, str, str]] = {
    # unknown and misplaced keys
    "unknown section": ({"modle": {"name": "x"}}, "modle", "modle", "did you mean 'model'"),
    "unknown key": ({"optim": {"lrr": 1e-3}}, "optim.lrr", "lrr", "did you mean 'lr'"),
    "misplaced key": (
        {"optim": {"group_size": 8}}, "optim.group_size", "group_size", "algorithm.group_size",
    ),
    "section not a mapping": ({"optim": [1, 2]}, "optim", "[1, 2]", "must be a mapping"),
    # wrong types
    "lr a word": ({"optim": {"lr": "fast"}}, "optim.lr", "'fast'", "e.g. lr: "),
    "group size a fraction": (
        {"algorithm": {"group_size": 2.5}}, "algorithm.group_size", "2.5", "e.g. group_size: 8",
    ),
    "elitism a number": (
        {"population": {"elitism": 3}}, "population.elitism", "(3)", "e.g. elitism: true",
    ),
    "fsdp a word": (
        {"distributed": {"fsdp": "yes"}}, "distributed.fsdp", "'yes'", "true or false",
    ),
    "fsdp field not a bool": (
        {"distributed": {"fsdp": {"reshard_after_forward": 1}}},
        "distributed.fsdp.reshard_after_forward", "(1)", "true or false",
    ),
    # choices
    "unknown algorithm": (
        {"algorithm": {"name": "PPG"}}, "algorithm.name", "'PPG'", "did you mean 'PPO'",
    ),
    "unknown loss": (
        {"algorithm": {"loss": "grpoo"}}, "algorithm.loss", "'grpoo'", "did you mean 'grpo'",
    ),
    "unknown engine": ({"rollout": {"engine": "sglang"}}, "rollout.engine", "'sglang'", "'vllm'"),
    "unknown device": ({"training": {"device": "tpu"}}, "training.device", "'tpu'", "'cuda'"),
    "unknown dtype": ({"model": {"dtype": "fp8"}}, "model.dtype", "'fp8'", "'bfloat16'"),
    "unknown strategy": (
        {"search": {"strategy": "grid"}}, "search.strategy", "'grid'", "'optuna'",
    ),
    # out of range
    "lr negative": ({"optim": {"lr": -1}}, "optim.lr", "-1.0", "1e-5 to 1e-3"),
    "lr zero": ({"optim": {"lr": 0}}, "optim.lr", "0.0", "must be > 0"),
    "group of one": ({"algorithm": {"group_size": 1}}, "algorithm.group_size", "(1)", "4 to 16"),
    "no prompts": (
        {"algorithm": {"prompts_per_step": 0}}, "algorithm.prompts_per_step", "(0)", "> 0",
    ),
    "clip negative": (
        {"algorithm": {"clip_low": -0.1}}, "algorithm.clip_low", "-0.1", "0.2 is usual",
    ),
    "beta negative": ({"algorithm": {"beta": -0.5}}, "algorithm.beta", "-0.5", "0 disables"),
    "temperature zero": (
        {"rollout": {"temperature": 0}}, "rollout.temperature", "0.0", "0.7 to 1.2",
    ),
    "top_p above one": ({"rollout": {"top_p": 1.5}}, "rollout.top_p", "1.5", "(0, 1]"),
    "top_k negative": ({"rollout": {"top_k": -1}}, "rollout.top_k", "-1", "0 disables"),
    "no new tokens": (
        {"rollout": {"max_output_tokens": 0}}, "rollout.max_output_tokens", "(0)", "> 0",
    ),
    "min above max": (
        {"rollout": {"min_output_tokens": 99, "max_output_tokens": 8}},
        "rollout.min_output_tokens", "99", "[0, max_output_tokens (8)]",
    ),
    "empty population": ({"population": {"size": 0}}, "population.size", "(0)", "> 0"),
    "no slots": ({"launch": {"slots": 0}}, "launch.slots", "(0)", "> 0"),
    "no steps": ({"training": {"steps": 0}}, "training.steps", "(0)", "> 0"),
    "rank zero": ({"lora": {"r": 0}}, "lora.r", "(0)", "8 or 16"),
    "dropout above one": ({"lora": {"dropout": 1.5}}, "lora.dropout", "1.5", "[0, 1)"),
    "mutation probability": (
        {"mutation": {"rl_hp": 1.5}}, "mutation.rl_hp", "1.5", "set rl_hp in [0, 1]",
    ),
    "vllm memory share": (
        {"rollout": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 1.5}}},
        "rollout.vllm.gpu_memory_utilization", "1.5", "0.2 to 0.5",
    ),
    # contradictions
    "tournament larger than population": (
        {"population": {"size": 2, "tournament_size": 5}},
        "population.tournament_size", "(5)", "lower tournament_size",
    ),
    "both offloads": (
        {"distributed": {"fsdp": {"cpu_offload": True, "optim_cpu_offload": True}},
         "rollout": {"engine": "vllm"}},
        "distributed.fsdp.cpu_offload", "optim_cpu_offload", "set optim_cpu_offload: false",
    ),
    "cpu offload without vllm": (
        {"distributed": {"fsdp": OFFLOAD}}, "distributed.fsdp.cpu_offload", "(true)",
        "set cpu_offload: false",
    ),
    "range upside down": (
        {"mutation": {"ranges": {"lr": {"min": 1e-3, "max": 1e-5}}}},
        "mutation.ranges.lr.min", "0.001", "lower min or raise max",
    ),
    "range of a fixed hyperparameter": (
        {"mutation": {"ranges": {"group_size": {"min": 2, "max": 8}}}},
        "mutation.ranges.group_size", "group_size", "mutable: lr",
    ),
    "too few gpus": (
        {"launch": {"gpus_per_member": 2, "slots": 2, "gpu_ids": [0, 1]}},
        "launch.gpu_ids", "2 GPUs", "list more GPUs or lower slots",
    ),
    "compile with fsdp": (
        {"training": {"compile": True}, "distributed": {"fsdp": True}},
        "training.compile", "(true)", "set compile: false",
    ),
    "vllm for sft": (
        {"rollout": {"engine": "vllm"}, "algorithm": {"name": "SFT"}},
        "rollout.engine", "'SFT'", "use engine: hf",
    ),
    # files
    "unknown task": (
        {"task": {"name": "builtin:nope"}}, "task.name", "'builtin:nope'", "builtin:letters",
    ),
    "missing dataset": (
        {"algorithm": {"name": "SFT"}, "task": {"name": "data/missing.jsonl"}},
        "task.name", "'data/missing.jsonl'", "JSONL path relative to the manifest's folder",
    ),
    "missing reward file": (
        {"task": {"reward": {"file": "missing.py", "function": "f"}}},
        "task.reward.file", "'missing.py'", ".py path relative to the manifest's folder",
    ),
    "missing reward function": (
        {"task": {"reward": {"file": "rewards.py", "function": "my_reward"}}},
        "task.reward.function", "'my_reward'", "it defines: other",
    ),
    "reward file not python": (
        {"task": {"reward": {"file": "rewards.txt", "function": "f"}}},
        "task.reward.file", "'rewards.txt'", "must be a .py file",
    ),
    "reward file broken": (
        {"task": {"reward": {"file": "broken.py", "function": "f"}}},
        "task.reward.file", "'broken.py'", "fix the file",
    ),
    "reward file with a NUL byte": (
        {"task": {"reward": {"file": "rewards\0.py", "function": "f"}}},
        "task.reward.file", "'rewards\\x00.py'", "holds a NUL byte",
    ),
    "memory limit too low": (
        {"launch": {"memory_limit_gib": 0.1}}, "launch.memory_limit_gib", "(0.1)",
        "leave it unset for no limit",
    ),
    # INIT_HP
    "INIT_HP not a mapping": ({"INIT_HP": 5}, "INIT_HP", "got 5", "{LR: 1e-5, GROUP_SIZE: 8}"),
    "INIT_HP unknown key": ({"INIT_HP": {"LRR": 1e-3}}, "INIT_HP.LRR", "LRR", "'LR'"),
    "INIT_HP contradicts a section": (
        {"INIT_HP": {"LR": 1e-3}, "optim": {"lr": 1e-4}},
        "INIT_HP.LR", "0.001", "give it in one place",
    ),
    "INIT_HP tournament too big": (
        {"INIT_HP": {"POP_SIZE": 2, "TOURNAMENT_SIZE": 5}},
        "population.tournament_size", "(5)", "lower tournament_size",
    ),
    "INIT_HP FSDP field": (
        {"INIT_HP": {"FSDP": {"offload_everything": True}}},
        "distributed.fsdp.offload_everything", "offload_everything", "valid: reshard_after_forward",
    ),
    "INIT_HP unknown algorithm": (
        {"INIT_HP": {"ALGO": "GRPOO"}}, "algorithm.name", "'GRPOO'", "did you mean 'GRPO'",
    ),
    "INIT_HP lr not a number": (
        {"INIT_HP": {"LR": "1e-3x"}}, "optim.lr", "'1e-3x'", "e.g. lr: ",
    ),
}  # fmt: skip


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A manifest folder with a reward file defining ``other``, a text file and a broken one."""
    (tmp_path / "rewards.py").write_text("def other(completion, answer, question):\n    return 0\n")
    (tmp_path / "rewards.txt").write_text("not python\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    return tmp_path


def test_the_corpus_is_large():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_message_with_key_value_and_fix(folder, name):
    sections, key, value, fix = CASES[name]
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(sections, base_dir=folder)
    assert len(err.value.problems) == 1, err.value.problems
    problem = err.value.problems[0]
    assert problem.startswith(key), problem
    assert value in problem and fix in problem, problem


@pytest.mark.parametrize(
    ("call", "fix"),
    [
        (dict(population_size=0), "population.size (0) must be > 0"),
        (dict(hp_config={"group_size": {"min": 2, "max": 8}}), "not a mutable hyperparameter"),
        (dict(algo="DQN"), "algorithm.name ('DQN') must be one of"),
        (dict(INIT_HP={"LR": -1.0}), "optim.lr (-1.0) must be > 0"),
    ],
)
def test_create_population_refuses_bad_input_before_loading_anything(call, fix):
    with pytest.raises(ConfigError) as err:
        create_population(**call)
    assert fix in str(err.value)


def _pbt_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pbt.cli", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.integration
def test_pbt_check_exits_2_without_traceback_for_every_case(folder):
    """Every case as a YAML file through the real command line, plus unreadable files."""
    files = {}
    for i, (name, (sections, *_)) in enumerate(CASES.items()):
        files[name] = folder / f"case{i}.yaml"
        files[name].write_text(yaml.safe_dump(sections))
    (folder / "unclosed.yaml").write_text("model: [unclosed\n")
    (folder / "list.yaml").write_text("- model\n- optim\n")
    (folder / "a-folder.yaml").mkdir()
    unreadable = {
        "missing file": (folder / "nowhere.yaml", "cannot read"),
        "invalid YAML": (folder / "unclosed.yaml", "not valid YAML"),
        "a list": (folder / "list.yaml", "top level must be a mapping"),
        "a folder": (folder / "a-folder.yaml", "cannot read"),
    }
    checks = [(name, path, CASES[name][1]) for name, path in files.items()]
    checks += [(name, path, text) for name, (path, text) in unreadable.items()]
    for name, path, expected in checks:
        proc = _pbt_check(path)
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, name
        assert expected in proc.stderr, (name, proc.stderr)


def test_validation_leaves_the_callers_dicts_alone(folder):
    sections = {"INIT_HP": {"LR": 1e-3}, "optim": {"lr": 1e-4}}
    with pytest.raises(ConfigError):
        manifest_from_dict(sections, base_dir=folder)
    assert sections == {"INIT_HP": {"LR": 1e-3}, "optim": {"lr": 1e-4}}
