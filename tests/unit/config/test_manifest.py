"""Manifests and INIT_HP dicts: typed, validated once, every problem reported together."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pbt.config.errors import ConfigError
from pbt.config.read.loader import load_manifest, manifest_from_dict
from pbt.worker.train import default_manifest_path


def _problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        manifest_from_dict(data)
    return info.value.problems


def test_packaged_quickstart_is_valid():
    manifest = load_manifest(default_manifest_path())
    assert manifest.model.name == "builtin:tiny"
    assert manifest.algorithm.group_size >= 2


def test_bad_manifest_lists_every_problem_in_one_message():
    bad = {
        "modle": {"name": "x"},
        "algorithm": {"group_size": 1, "lr": 0.1, "loss_aggregation": "mean"},
        "optim": {"max_grad_norm": "big"},
        "rollout": {"temperature": -1},
        "distributed": {"fsdp": {"cpu_offload": True}},
    }
    with pytest.raises(ConfigError) as info:
        manifest_from_dict(bad)
    message = str(info.value)
    assert message.startswith("manifest: 8 problems")
    expected = [
        "modle is not a known key; did you mean 'model'?",
        "algorithm.lr is not a known key; it belongs in the optim section (optim.lr)",
        "algorithm.loss_aggregation ('mean') must be one of 'token-mean', 'sequence-mean'",
        "optim.max_grad_norm ('big') must be a number",
        "algorithm.group_size (1) must be >= 2",
        "rollout.temperature (-1.0) must be > 0",
    ]
    for text in expected:
        assert text in message, text
    assert "set optim_cpu_offload: false" in message
    assert "needs a vLLM rollout" in message


def test_init_hp_maps_agilerl_spelling_onto_configs():
    manifest = manifest_from_dict(
        {
            "INIT_HP": {
                "ALGO": "GRPO",
                "LR": 5e-6,
                "BETA": 0.001,
                "GROUP_SIZE": 6,
                "CLIP_COEF": 0.25,
                "BATCH_SIZE": 2,
                "MAX_GRAD_NORM": 0.1,
                "UPDATE_EPOCHS": 2,
                "TEMPERATURE": 0.9,
                "MAX_OUTPUT_TOKENS": 32,
                "FSDP": True,
            },
            "algorithm": {"prompts_per_step": 2},
        }
    )
    assert manifest.optim.lr == 5e-6 and manifest.optim.max_grad_norm == 0.1
    assert manifest.algorithm.beta == 0.001 and manifest.algorithm.group_size == 6
    assert manifest.algorithm.clip_low == manifest.algorithm.clip_high == 0.25
    # AgileRL's BATCH_SIZE is prompts per step (agreeing with the section), not a memory setting
    assert manifest.algorithm.prompts_per_step == 2 and manifest.algorithm.micro_batch_size is None
    assert manifest.algorithm.update_epochs == 2
    assert manifest.rollout.temperature == 0.9 and manifest.rollout.max_output_tokens == 32
    assert manifest.distributed.fsdp is True


def test_init_hp_problems_unknown_keys_and_contradictions():
    problems = _problems({"INIT_HP": {"GROUP_SIZ": 8, "LR": 1e-5}, "optim": {"lr": 1e-4}})
    assert "INIT_HP.GROUP_SIZ is not a known key; did you mean 'GROUP_SIZE'?" in problems
    assert any("INIT_HP.LR (1e-05) contradicts optim.lr (0.0001)" in p for p in problems)


def test_fsdp_dict_fields_are_checked():
    problems = _problems(
        {"INIT_HP": {"FSDP": {"reshard_after_forwad": True, "cpu_offload": "yes"}}}
    )
    assert any("fsdp.reshard_after_forwad is not an FSDPConfig field" in p for p in problems)
    assert any("fsdp.cpu_offload ('yes') must be true or false" in p for p in problems)


def test_batch_sizes_must_divide():
    problems = _problems(
        {"algorithm": {"group_size": 4, "prompts_per_step": 3, "mini_batch_size": 5}}
    )
    assert any("mini_batch_size (5) must divide the completions per step" in p for p in problems)


def test_yaml_number_without_dot_is_accepted(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("optim:\n  lr: 5e-4\n")
    assert load_manifest(path).optim.lr == 5e-4


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_manifest(path)


def test_entry_point_prints_problems_without_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm:\n  group_size: 1\ntraining:\n  stepz: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pbt.worker.train", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "algorithm.group_size (1) must be >= 2" in proc.stderr
    assert "training.stepz is not a known key; did you mean 'steps'?" in proc.stderr


def test_cpu_offload_needs_a_vllm_rollout():
    problems = _problems({"INIT_HP": {"FSDP": {"cpu_offload": True, "optim_cpu_offload": False}}})
    assert problems == [
        "distributed.fsdp.cpu_offload (true) needs a vLLM rollout, but rollout.engine is 'hf': "
        "HF generate needs the weights on the compute device; set cpu_offload: false"
    ]


def test_campaign_sections_are_checked():
    problems = _problems(
        {
            "population": {"size": 0, "evo_steps": 0},
            "budget": {"generations": 0},
            "launch": {"slots": 0, "gpus_per_member": 2, "gpu_ids": [0]},
        }
    )
    for text in (
        "population.size (0) must be > 0",
        "population.evo_steps (0) must be > 0",
        "budget.generations (0) must be > 0",
        "launch.slots (0) must be > 0",
    ):
        assert any(text in p for p in problems), (text, problems)


# -- numbers and YAML, read strictly -----------------------------------------------------------


def test_anchors_aliases_and_merge_keys_that_repeat_a_value_are_read(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(
        "optim: &optim\n  lr: &lr 2.0e-4\n  weight_decay: 0.01\n"
        "mutation:\n  ranges:\n    lr: {min: 1.0e-5, max: *lr}\n"
        "rollout:\n  <<: {temperature: 0.7, top_k: 5}\n  temperature: 0.9\n"  # merged, overridden
    )
    manifest = load_manifest(path)
    assert manifest.optim.lr == 2.0e-4 and manifest.mutation.ranges["lr"]["max"] == 2.0e-4
    assert (manifest.rollout.temperature, manifest.rollout.top_k) == (0.9, 5)


def test_bounds_hold_for_configs_built_in_python_too():
    from pbt.config.sections.campaign import LaunchConfig
    from pbt.config.sections.training import TrainingConfig

    assert LaunchConfig(task_timeout_s=-1.0).check("launch") == [
        "launch.task_timeout_s (-1.0) must be > 0"
    ]
    assert LaunchConfig(heartbeat_timeout_s=float("nan")).check("launch") == [
        "launch.heartbeat_timeout_s (nan) must be a finite number > 0"
    ]
    assert TrainingConfig(steps=0, seed=-1).check("training") == [
        "training.steps (0) must be > 0",
        "training.seed (-1) must be >= 0",
    ]
    assert LaunchConfig(gpu_ids=[0, -2]).check("launch") == ["launch.gpu_ids[1] (-2) must be >= 0"]


def test_every_float_field_refuses_nan_and_infinities():
    """Each float field of every section, given NaN: one problem naming it."""
    import dataclasses
    import typing

    from pbt.config.manifest import SECTIONS, Manifest

    hints = typing.get_type_hints(Manifest)
    checked = 0
    for section in SECTIONS:
        cls = hints[section]
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is list or float not in (hint, *typing.get_args(hint)):
                continue
            if name not in {f.name for f in dataclasses.fields(cls) if f.init}:
                continue
            for bad in (float("nan"), float("inf"), float("-inf")):
                problems = _problems({section: {name: bad}})
                assert problems[0].startswith(f"{section}.{name} ({bad}) must be a finite"), (
                    problems
                )
            checked += 1
    assert checked >= 30, checked
