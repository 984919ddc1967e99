"""A member as a torchrun group on CPU (gloo): data parallel and FSDP2 give the losses of one
rank on the same global batch, and checkpoints move between world sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import DRIVERS

from pbt.config.errors import ConfigError

DRIVER = DRIVERS / "grpo_driver.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TOL = 1e-5  # float32 sums in a different order: losses agree to ~1e-7 in practice


def _launch(out: Path, ranks: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks == 1:
        cmd = [sys.executable, str(DRIVER), str(out), *args]
    else:
        cmd = [
            TORCHRUN,
            f"--nproc_per_node={ranks}",
            "--standalone",
            str(DRIVER),
            str(out),
            *args,
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(out.read_text())["losses"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank, data parallel, FSDP2 and FSDP2 without deferred sync, four steps each;
    the one-rank and FSDP2 runs also save a checkpoint after step 2."""
    d = tmp_path_factory.mktemp("dist")
    _launch(d / "one.json", 1, "--steps", "4", "--save-at", "2", str(d / "ckpt-one"))
    _launch(d / "dp.json", 2, "--steps", "4")
    _launch(d / "fsdp.json", 2, "--steps", "4", "--fsdp", "--save-at", "2", str(d / "ckpt-fsdp"))
    _launch(d / "fsdp-nodefer.json", 2, "--steps", "4", "--fsdp", "--no-defer")
    return d


pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["dp", "fsdp", "fsdp-nodefer"])
def test_two_ranks_match_one_rank(runs: Path, name: str):
    one, two = _losses(runs / "one.json"), _losses(runs / f"{name}.json")
    assert one.keys() == two.keys() == {1, 2, 3, 4}
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=TOL), (name, step)
    a, b = torch.load(runs / "one.json.pt"), torch.load(runs / f"{name}.json.pt")
    for key in a:
        # Adam divides by sqrt(v): float noise in tiny gradients grows to ~1e-5 of weight, far
        # below one step (lr 5e-3) that a wrong gradient would move it
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=5e-5)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)


def test_fsdp_checkpoint_continues_on_one_rank(runs: Path, tmp_path: Path):
    _launch(tmp_path / "resumed.json", 1, "--steps", "4", "--load", str(runs / "ckpt-fsdp"))
    resumed, straight = _losses(tmp_path / "resumed.json"), _losses(runs / "fsdp.json")
    assert resumed.keys() == {3, 4}
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], abs=TOL)


def test_one_rank_checkpoint_continues_sharded(runs: Path, tmp_path: Path):
    _launch(
        tmp_path / "resumed.json", 2, "--steps", "4", "--fsdp", "--load", str(runs / "ckpt-one")
    )
    resumed, straight = _losses(tmp_path / "resumed.json"), _losses(runs / "one.json")
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], abs=TOL)


def test_checkpoints_are_the_same_whatever_the_world_size(runs: Path):
    a = torch.load(runs / "ckpt-one" / "attributes.pt", weights_only=True)
    b = torch.load(runs / "ckpt-fsdp" / "attributes.pt", weights_only=True)
    assert a["trainable"].keys() == b["trainable"].keys()
    assert a["learner"]["optimizer"]["state"].keys() == b["learner"]["optimizer"]["state"].keys()
    for key in a["trainable"]:
        assert a["trainable"][key].shape == b["trainable"][key].shape
    assert (a["world_size"], b["world_size"]) == (1, 2)


def test_a_hung_rank_becomes_a_clear_error_not_a_hang(tmp_path: Path):
    start = time.monotonic()
    proc = _launch(tmp_path / "h.json", 2, "--steps", "2", "--hang-rank", "1", check=False)
    assert proc.returncode != 0
    assert time.monotonic() - start < 120
    assert "did not reach a collective within distributed.timeout_s (5 s)" in proc.stderr


def test_fsdp_config_rules():
    from pbt.config.sections.fsdp import FSDPConfig
    from pbt.distributed.fsdp import shard_model

    with pytest.raises(ConfigError, match="set optim_cpu_offload: false"):
        FSDPConfig(cpu_offload=True)
    with pytest.raises(
        ConfigError, match=r"FSDPConfig.optim_cpu_offload \('yes'\) must be true or false"
    ):
        FSDPConfig(**{"optim_cpu_offload": "yes"})
    with pytest.raises(ConfigError, match="launch the member with torchrun"):
        shard_model(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), FSDPConfig(), torch.device("cpu"))
    assert FSDPConfig.from_value(None) is None and FSDPConfig.from_value(False) is None


def test_fsdp_config_fields_match_the_manifest_schema():
    import dataclasses

    from pbt.config import FSDP_FIELDS
    from pbt.config.sections.fsdp import FSDPConfig

    fields = {f.name: f.default for f in dataclasses.fields(FSDPConfig)}
    assert fields == FSDP_FIELDS


def test_sharded_member_trains_generates_and_resumes_on_one_rank(tmp_path: Path):
    import yaml

    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "INIT_HP": {"FSDP": True, "GROUP_SIZE": 4, "LR": 5e-3, "MAX_OUTPUT_TOKENS": 6},
                "algorithm": {"prompts_per_step": 2},
                "task": {"eval_size": 6},
                "training": {"steps": 2, "device": "cpu", "output_dir": "out"},
            }
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [TORCHRUN, "--nproc_per_node=2", "--standalone", "-m", "pbt.worker.train", str(manifest)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("step    2/2") == 1  # only rank 0 prints
    assert (tmp_path / "out" / "checkpoint" / "manifest.json").is_file()
    resume = [
        TORCHRUN,
        "--nproc_per_node=1",
        "--standalone",
        "-m",
        "pbt.worker.train",
        str(manifest),
        "--resume",
        "out/checkpoint",
        "--steps",
        "3",
        "--output-dir",
        "out1",
    ]
    proc = subprocess.run(
        resume, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step    3/3" in proc.stdout
