"""The bad-input corpus: malformed manifests and ``INIT_HP`` dicts, each refused with one message
that names the key, the value and the fix; ``pbt check`` exits 2 with no traceback.

Each case is ``(sections, key, value, fix)``: the message must contain all three strings.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pbt.config.errors import ConfigError
from pbt.config.read.loader import load_manifest, manifest_from_dict
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
        {"mutation": {"ranges": {"update_epochs": {"min": 1, "max": 4}}}},
        "mutation.ranges.update_epochs", "update_epochs", "mutable: lr",
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
        {"algorithm": {"name": "SFT"}, "task": {"name": None, "train": "data/missing.jsonl"}},
        "task.train", "'data/missing.jsonl'", "relative to the manifest's folder",
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
    "lr NaN": ({"optim": {"lr": float("nan")}}, "optim.lr", "(nan)", "not NaN or infinity"),
    "dual clip infinite": (
        {"algorithm": {"dual_clip": float("inf")}}, "algorithm.dual_clip", "(inf)", "finite",
    ),
    "negative task timeout": (
        {"launch": {"task_timeout_s": -1}}, "launch.task_timeout_s", "(-1.0)", "must be > 0",
    ),
    "seed past 64 bits": (
        {"training": {"seed": 2**64}}, "training.seed", "1844674", "below 2**63",
    ),
    "INIT_HP lr infinite": (
        {"INIT_HP": {"LR": float("-inf")}}, "optim.lr", "(-inf)", "not NaN or infinity",
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
    # where vLLM is absent, a vllm rollout also names the install (test_vllm.py checks that one)
    problems = [p for p in err.value.problems if "vLLM is not installed" not in p]
    assert len(problems) == 1, err.value.problems
    problem = problems[0]
    assert problem.startswith(key), problem
    assert value in problem and fix in problem, problem


@pytest.mark.parametrize(
    ("call", "fix"),
    [
        (dict(population_size=0), "population.size (0) must be > 0"),
        (dict(hp_config={"update_epochs": {"min": 1, "max": 4}}), "not a mutable hyperparameter"),
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


def _bad_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """Manifest files no command can start from, each with a part of the message it gets."""
    (folder / "unclosed.yaml").write_text("model: [unclosed\n")
    (folder / "latin1.yaml").write_bytes(b"model:\n  name: caf\xe9\n")
    (folder / "list.yaml").write_text("- model\n- optim\n")
    (folder / "typo.yaml").write_text("optim:\n  lrr: 1.0e-4\n")
    (folder / "a-folder.yaml").mkdir()
    return {
        "missing file": (folder / "nowhere.yaml", "No such file or directory; check the path"),
        "a folder": (folder / "a-folder.yaml", "Is a directory; check the path"),
        "not UTF-8": (folder / "latin1.yaml", "byte 0xe9 at offset 18 is not UTF-8 text"),
        "invalid YAML": (folder / "unclosed.yaml", "not valid YAML at line 2, column 1"),
        "a list": (folder / "list.yaml", "top level must be a mapping"),
        "a typo": (folder / "typo.yaml", "optim.lrr is not a known key; did you mean 'lr'?"),
    }


def _pbt_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run several ``pbt`` commands at once (each exits at once) and collect them."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "pbt.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_run_refuses_a_bad_manifest_file_as_check_does(folder):
    """``pbt run`` reads the file once and, like ``pbt check``, names it in one message:
    exit 2, no traceback, and no campaign directory left behind."""
    files = _bad_files(folder)
    commands = {}
    for name, (path, _) in files.items():
        commands[f"run {name}"] = ["run", str(path), "--dir", str(folder / f"c-{len(commands)}")]
        commands[f"check {name}"] = ["check", str(path)]
    done = _pbt_all(commands)
    for name, (path, expected) in files.items():
        run, check = done[f"run {name}"], done[f"check {name}"]
        assert run.returncode == 2, (name, run.returncode, run.stderr)
        assert "Traceback" not in run.stderr + run.stdout, (name, run.stderr)
        assert run.stderr.startswith(f"error: {path}: 1 problem\n"), (name, run.stderr)
        assert expected in run.stderr, (name, run.stderr)
        assert run.stderr == check.stderr, name
        assert len(run.stderr.splitlines()) == 2, (name, run.stderr)
    assert not list(folder.glob("c-*")), "a refused manifest created a campaign directory"


def test_resume_refuses_a_folder_that_holds_no_campaign(folder):
    (folder / "empty").mkdir()
    (folder / "junk").mkdir()
    (folder / "junk" / "store.db").write_text("not a database\n")
    cases = {
        "missing folder": (folder / "nowhere", "holds no campaign (no store.db)"),
        "empty folder": (folder / "empty", "holds no campaign (no store.db)"),
        "a file": (folder / "rewards.py", "holds no campaign (no store.db)"),
        "junk store": (folder / "junk", "is not a usable SQLite database"),
    }
    done = _pbt_all({name: ["resume", str(path)] for name, (path, _) in cases.items()})
    for name, (path, expected) in cases.items():
        proc = done[name]
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, (name, proc.stderr)
        assert str(path) in proc.stderr and expected in proc.stderr, (name, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1, (name, proc.stderr)
    assert sorted(p.name for p in (folder / "empty").iterdir()) == []


def test_a_loaded_manifest_names_its_file_in_every_problem_header(folder):
    path = folder / "m.yaml"
    path.write_text("optim:\n  lrr: 1.0e-4\nalgorithm:\n  group_size: 1\n")
    with pytest.raises(ConfigError) as err:
        load_manifest(path)
    assert err.value.source == str(path)
    assert str(err.value).startswith(f"{path}: 2 problems")


def test_loading_leaves_the_callers_dicts_alone(folder):
    """INIT_HP is folded into the sections of a copy, also when everything is valid."""
    sections = {
        "INIT_HP": {"LR": 1e-4, "POP_SIZE": 3},
        "optim": {},
        "mutation": {"ranges": {"lr": {"min": 1e-5, "max": 1e-3}}},
    }
    before = copy.deepcopy(sections)
    manifest = manifest_from_dict(sections, base_dir=folder)
    assert manifest.optim.lr == 1e-4 and manifest.population.size == 3
    assert sections == before
    manifest.mutation.ranges["lr"]["min"] = 0.5
    assert sections == before, "the manifest shares a dict with its input"


def test_create_population_leaves_the_callers_manifest_and_dicts_alone(folder):
    manifest = manifest_from_dict(
        {"training": {"device": "cpu"}, "population": {"size": 4}}, base_dir=folder
    )
    before = dataclasses.asdict(manifest)
    pop = create_population(
        manifest=manifest,
        model_name="builtin:tiny",
        device="cpu",
        population_size=2,
        hp_config={"lr": {"min": 1e-5, "max": 1e-3}},
        init_sampler="random",
    )
    assert dataclasses.asdict(manifest) == before
    assert pop.manifest is not manifest and len(pop) == 2
    assert pop.manifest.population.init_sampler == "random"
    assert set(pop.manifest.mutation.ranges) == {"lr"}
    with pytest.raises(ConfigError, match=r"population\.size \(0\)"):
        create_population(manifest=manifest, population_size=0)
    assert dataclasses.asdict(manifest) == before

    init_hp, config = {"LR": 1e-4, "POP_SIZE": 4}, {"training": {"device": "cpu"}}
    given = copy.deepcopy((init_hp, config))
    pop = create_population(INIT_HP=init_hp, config=config, model_name="x", population_size=2)
    assert (init_hp, config) == given
    assert len(pop) == 2 and pop.manifest.model.name == "x"
