"""The vLLM rollout's settings (``rollout.vllm``): each bad one refused with its fix, whether
vLLM is installed or not; the engine itself is tests/integration/test_vllm.py's."""

from __future__ import annotations

import importlib.util

import pytest
from support import small_sections

from pbt.config.errors import ConfigError
from pbt.config.read.loader import manifest_from_dict

INSTALLED = importlib.util.find_spec("vllm") is not None


def _vllm_manifest(tmp_path, algorithm=None, launch=None, **vllm):
    sections = small_sections(
        tmp_path,
        rollout={"engine": "vllm", "vllm": vllm},
        algorithm=algorithm or {},
        launch=launch or {},
    )
    return manifest_from_dict(sections, base_dir=tmp_path)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"gpu_memory_utilization": 1.5}, "rollout.vllm.gpu_memory_utilization (1.5) must be in"),
        ({"max_num_seqs": 0}, "rollout.vllm.max_num_seqs (0) must be > 0"),
        ({"importance_cap": -1.0}, "rollout.vllm.importance_cap (-1.0) must be >= 0"),
        ({"engine_kwargs": {"model": "x"}}, "engine_kwargs.model is set by the vLLM rollout"),
        ({"engine_kwargs": {"max_num_seqs": 8}}, "set rollout.vllm.max_num_seqs instead"),
        ({"max_model_len": 4}, "rollout.vllm.max_model_len (4) leaves no room"),
        ({"dtype": "fp8"}, "rollout.vllm.dtype ('fp8') must be one of"),
        ({"sleep": True}, "rollout.vllm.sleep is not a known key; did you mean 'sleep_mode'?"),
    ],
)
def test_bad_vllm_settings_are_refused_with_the_fix(tmp_path, settings, message):
    with pytest.raises(ConfigError) as err:
        _vllm_manifest(tmp_path, **settings)
    assert message in str(err.value)


def test_tensor_parallel_size_must_fit_the_member(tmp_path):
    with pytest.raises(ConfigError) as err:
        _vllm_manifest(tmp_path, launch={"nproc_per_member": 2}, tensor_parallel_size=4)
    message = str(err.value)
    assert (
        "tensor_parallel_size (4) must be 1 (an engine per rank) or the member's ranks" in message
    )
    assert "set it to 1 or 2" in message
    with pytest.raises(ConfigError) as err:
        _vllm_manifest(tmp_path, launch={"gpus_per_member": 2}, tensor_parallel_size=3)
    assert "the member's GPUs (2, one engine" in str(err.value)


def test_vllm_rollouts_are_for_rl_algorithms(tmp_path):
    with pytest.raises(ConfigError) as err:
        _vllm_manifest(tmp_path, algorithm={"name": "SFT"})
    assert "algorithm.name is 'SFT', which samples nothing; use engine: hf" in str(err.value)


def test_cpu_offload_needs_vllm_rollouts(tmp_path):
    fsdp = {"cpu_offload": True, "optim_cpu_offload": False}
    sections = small_sections(tmp_path, distributed={"fsdp": fsdp})
    with pytest.raises(ConfigError) as err:
        manifest_from_dict(sections, base_dir=tmp_path)
    assert "distributed.fsdp.cpu_offload (true) needs a vLLM rollout" in str(err.value)
    if INSTALLED:
        sections["rollout"] = {**sections["rollout"], "engine": "vllm"}
        manifest_from_dict(sections, base_dir=tmp_path)  # accepted with vLLM rollouts


def test_missing_vllm_is_reported_with_the_install_command(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        _vllm_manifest(tmp_path)
    assert "vLLM is not installed" in str(err.value) and "pbt-llm[vllm]" in str(err.value)
