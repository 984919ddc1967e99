"""The member entry point as a user runs it: torchrun on CPU, resume, and learning."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from support import REPO

from pbt.algorithms.runtime.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration

SMALL = {
    "optim": {"lr": 5e-3},
    "algorithm": {"group_size": 4, "prompts_per_step": 2},
    "rollout": {"max_output_tokens": 6},
    "task": {"name": "builtin:letters", "eval_size": 8},
    "training": {"steps": 3, "device": "cpu"},
}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
"""``torchrun`` itself (its console script runs this module), under this interpreter: a copied
virtualenv's ``torchrun`` script may name another one in its first line."""


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _done_line(stdout: str) -> tuple[float, float]:
    match = re.search(r"done: held-out reward ([\d.]+) -> ([\d.]+)", stdout)
    assert match, stdout[-2000:]
    return float(match.group(1)), float(match.group(2))


def test_torchrun_trains_checkpoints_and_resumes(tmp_path):
    """The public manifest launch, as AgileRL's page writes it (``-m pbt.train``): two ranks,
    data parallel on the CPU with gloo, train two steps and save one checkpoint; ``python -m
    pbt.train --resume`` continues it on one rank."""
    manifest = tmp_path / "member.yaml"
    training = {**SMALL["training"], "steps": 2, "output_dir": "out"}
    manifest.write_text(yaml.safe_dump({**SMALL, "training": training}))
    proc = _run(
        [*TORCHRUN, "--nproc_per_node=2", "--standalone", "-m", "pbt.train", str(manifest)],
        tmp_path,
    )
    assert "x2 ranks (data parallel)" in proc.stdout and "step    2/2" in proc.stdout
    assert proc.stdout.count("done: ") == 1  # rank 0 alone speaks and writes
    attrs = load_checkpoint(tmp_path / "out" / "checkpoint")
    assert attrs["step"] == 2 and len(attrs["fitness"]) == 1
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "reward_mean" in x] == [1, 2]

    resumed = _run(
        [
            sys.executable,
            "-m",
            "pbt.train",
            str(manifest),
            "--resume",
            "out/checkpoint",
            "--steps",
            "4",
            "--output-dir",
            "out2",
        ],
        tmp_path,
    )
    assert "step    3/4" in resumed.stdout and "step    1/" not in resumed.stdout
    assert load_checkpoint(tmp_path / "out2" / "checkpoint")["step"] == 4


def test_quickstart_member_learns(tmp_path):
    """The README's quickstart, shortened: the held-out reward must rise by a margin that a
    run with a learning rate of ~0 (the control, 5 steps: its greedy held-out reward moves only
    if its weights do) does not show."""
    learned = _run(
        [sys.executable, "-m", "pbt.cli", "train", "--steps", "20", "--output-dir", "a"],
        tmp_path,
    )
    before, after = _done_line(learned.stdout)
    control_manifest = tmp_path / "control.yaml"
    quickstart = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    quickstart["optim"]["lr"] = 1e-9
    control_manifest.write_text(yaml.safe_dump(quickstart))
    control = _run(
        [
            sys.executable,
            "-m",
            "pbt.train",
            str(control_manifest),
            "--steps",
            "5",
            "--output-dir",
            "b",
        ],
        tmp_path,
    )
    c_before, c_after = _done_line(control.stdout)
    assert c_before == before
    assert after - before >= 0.2, learned.stdout[-3000:]
    assert abs(c_after - c_before) < 0.05, control.stdout[-3000:]


def test_wheel_installs_one_import_root(tmp_path):
    repo = REPO
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",  # the build backend's own output: setuptools' warnings included
            "-w",
            str(tmp_path / "dist"),
            str(repo),
        ],
        tmp_path,
    )
    warned = [line for line in (built.stdout + built.stderr).splitlines() if "Warning:" in line]
    assert not warned, warned  # no wall of setuptools warnings at set-up
    wheel = next((tmp_path / "dist").glob("pbt_llm-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"pbt"}, tops
    assert "pbt/algorithms/grpo.py" in names and "pbt/distributed/process_group.py" in names
    assert "pbt/train.py" in names  # torchrun -m pbt.train
    assert "pbt/configs/quickstart.yaml" in names
    example = repo / "configs" / "examples" / "own_task"
    shipped = {f"pbt/configs/examples/own_task/{p.name}" for p in example.iterdir() if p.is_file()}
    assert shipped <= set(names), shipped - set(names)  # the worked example, rows and rewards
    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {  # every package of every root, found by setup.py rather than listed
        "/".join(
            [*package.split("."), *init.parent.relative_to(repo / folder).parts, "__init__.py"]
        )
        for package, folder in mapping["package-dir"].items()
        for init in (repo / folder).rglob("__init__.py")
    }
    assert "pbt/algorithms/runtime/__init__.py" in packages, packages
    assert packages <= set(names), packages - set(names)
    assert not [n for n in names if n.startswith("pbt/configs/") and "scale" in n]  # bench's own
    target = tmp_path / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        tmp_path,
    )
    probe = (
        "import pbt, pbt.algorithms.grpo, pbt.distributed, pbt.train, pbt.worker.train;"
        "print(pbt.__file__);"
        "print(pbt.worker.train.default_manifest_path().is_file())"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(target / "pbt" / "__init__.py"), "True"]
