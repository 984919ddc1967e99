"""The launch settings without a cluster: members sharing a GPU, the Slurm backend's rules,
the batch script it writes, job states as return codes, and what ``pbt submit`` and ``pbt
stop`` refuse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pbt.config.errors import PbtError
from pbt.config.sections.campaign import LaunchConfig, SlurmConfig
from pbt.launch.slurm import JobState, batch_script, slurm_member_command
from tests.support import small_sections


def _problems(**launch) -> list[str]:
    slurm = launch.pop("slurm", {})
    config = LaunchConfig(backend="slurm", slurm=SlurmConfig(**slurm), **launch)
    return config.check("launch")


def test_slurm_settings_are_checked_with_the_fix_named() -> None:
    assert _problems() == []
    assert _problems(gpus_per_member=8, slurm={"nodes_per_member": 2, "gpus_per_node": 4}) == []
    (bad_time,) = _problems(slurm={"time": "four hours"})
    assert "launch.slurm.time ('four hours')" in bad_time and '"HH:MM:SS"' in bad_time
    (split,) = _problems(gpus_per_member=8, slurm={"nodes_per_member": 3})
    assert "launch.gpus_per_member (8)" in split and "nodes_per_member (3)" in split
    (agents,) = _problems(nproc_per_member=3, slurm={"tasks_per_node": 2})
    assert "nproc_per_member (3)" in agents and "agents" in agents
    (option,) = _problems(slurm={"extra_sbatch": ["exclusive"]})
    assert "extra_sbatch[0] ('exclusive')" in option and '"--exclusive"' in option
    (gpus,) = _problems(gpu_ids=[0, 1])
    assert "gpu_ids" in gpus and "drop gpu_ids" in gpus
    (memory,) = _problems(memory_limit_gib=4.0)
    assert "launch.slurm.mem" in memory


def test_the_batch_script_starts_one_agent_per_node(tmp_path: Path) -> None:
    config = SlurmConfig(
        partition="gpu", account="proj", time="1-00:00:00", nodes_per_member=2,
        gpus_per_node=8, mem="400G", extra_sbatch=["--exclusive"],
        setup=["source /shared/venv/bin/activate"],
    )  # fmt: skip
    script = batch_script(
        config, name="pbt-c1", command=[*slurm_member_command(), "/runs/c 1/task.json"],
        nproc=16, gpus_per_member=16, log_path=tmp_path / "m.log", workdir=tmp_path,
        env={"OMP_NUM_THREADS": "4"},
    )  # fmt: skip
    lines = script.splitlines()
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                     "#SBATCH --account=proj", "#SBATCH --time=1-00:00:00", "#SBATCH --mem=400G",
                     "#SBATCH --exclusive", "source /shared/venv/bin/activate",
                     "export OMP_NUM_THREADS=4", "PBT_NNODES=2", "PBT_NPROC=8"):  # fmt: skip
        assert expected in lines, expected
    assert "qos" not in script and "CUDA_VISIBLE_DEVICES" not in script
    srun = lines[-1]
    assert srun.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 ")
    assert '--nnodes="$PBT_NNODES"' in srun and '--rdzv_endpoint="$PBT_ENDPOINT"' in srun
    assert '--rdzv_id="$SLURM_JOB_ID"' in srun and "'/runs/c 1/task.json'" in srun
    # the script is valid bash
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_a_cpu_member_hides_the_gpus_and_splits_its_ranks(tmp_path: Path) -> None:
    config = SlurmConfig(tasks_per_node=2, time=None)
    script = batch_script(
        config, name="t", command=["python", "-m", "pbt.worker"], nproc=4, gpus_per_member=0,
        log_path=tmp_path / "l", workdir=tmp_path, env={},
    )  # fmt: skip
    assert 'export CUDA_VISIBLE_DEVICES=""' in script and "--gpus" not in script
    assert "PBT_NNODES=2" in script and "PBT_NPROC=2" in script and "--time" not in script


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (JobState("COMPLETED", exit_code=0, signal=0), 0),
        (JobState("FAILED", exit_code=3, signal=0), 3),
        (JobState("CANCELLED", exit_code=0, signal=15), -15),
        (JobState("TIMEOUT", exit_code=0, signal=0), 1),
        (JobState("UNKNOWN"), 1),
    ],
)
def test_an_ended_job_has_a_return_code(state: JobState, expected: int) -> None:
    assert state.ended and state.returncode == expected
    assert not JobState("PENDING", "Resources").ended


def test_submit_needs_the_slurm_backend_and_stop_needs_a_campaign(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(small_sections(tmp_path)))
    pbt = [sys.executable, "-m", "pbt.cli"]
    done = subprocess.run([*pbt, "submit", str(manifest), "--dir", str(tmp_path / "c")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "launch.backend: slurm" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([*pbt, "stop", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "holds no campaign" in done.stderr


def test_submit_files_do_not_block_the_campaign_folder(tmp_path: Path) -> None:
    from pbt.controller.campaign import Campaign

    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "controller.sbatch").write_text("#!/bin/bash\n")
    (folder / "other").write_text("")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(small_sections(tmp_path)))
    with pytest.raises(PbtError, match="not empty"):
        Campaign.start(manifest, folder)
    (folder / "other").unlink()
    Campaign.start(manifest, folder).close()  # pbt submit's own files are allowed
    assert (folder / "store.db").exists() and (folder / "controller.sbatch").exists()


def test_members_per_gpu_rules() -> None:
    def problems(**launch) -> list[str]:
        return LaunchConfig(**launch).check("launch")

    assert problems(gpus_per_member=1, slots=8, members_per_gpu=8, gpu_ids=[0]) == []
    assert LaunchConfig(gpus_per_member=2, slots=5, members_per_gpu=2).gpus_needed == 6
    (short,) = problems(gpus_per_member=1, slots=8, members_per_gpu=4, gpu_ids=[0])
    assert "launch.gpu_ids has 1 GPUs but the slots need 2" in short
    (cpu,) = problems(slots=2, members_per_gpu=2)
    assert "launch.members_per_gpu (2)" in cpu and "no GPUs" in cpu
    (zero,) = problems(gpus_per_member=1, members_per_gpu=0)
    assert "launch.members_per_gpu" in zero
