"""Where dedicated rollout engines run: GPUs of their own when the visible devices hold them,
beside their trainers under MPS when not, the CPU without GPUs; ``auto`` resolved from the
spare devices; one line when nothing fits; and the launcher's slots get those devices."""

from __future__ import annotations

import pytest

from pbt.config.sections.campaign import LaunchConfig, SlurmConfig
from pbt.controller.campaign import Campaign
from pbt.launch.build import build_launcher
from pbt.launch.handahead import HandAhead
from pbt.launch.placement import PlacementError, placement_for, plan_placement, visible_gpus
from pbt.launch.slurm import batch_script
from pbt.protocol.engines import PLACEMENT_ENV, EnginePlacement


def _plan(devices, slots=1, gpus=1, per_gpu=1, ranks=None, engines=1, mode="async", mps=True):
    return plan_placement(
        devices=devices, slots=slots, gpus_per_member=gpus, members_per_gpu=per_gpu,
        ranks=ranks or max(gpus, 1), engines=engines, mode=mode, mps=mps,
    )  # fmt: skip


def test_engines_get_gpus_of_their_own_after_every_trainer_gpu() -> None:
    p = _plan(list(range(8)), slots=2, gpus=2, engines=2)
    assert (p.kind, p.engines_per_member, p.engine_gpus_per_member) == ("dedicated", 2, 2)
    assert p.slot_devices == ("0,1,4,5", "2,3,6,7")  # trainers 0-3, engines 4-7
    assert "GPUs of their own" in p.note and "slot 1: 2,3,6,7" in p.note
    # physical ids as listed, not positions; slots sharing a GPU group share its engine GPU
    shared = _plan([3, 5, 9, 11], slots=4, per_gpu=2)
    assert shared.slot_devices == ("3,9", "3,9", "5,11", "5,11")


def test_short_of_devices_engines_share_their_trainers_gpu_under_mps_or_are_refused() -> None:
    one = _plan([0], mps=False)  # one GPU: shared, time-sliced without MPS
    assert (one.kind, one.slot_devices, one.engine_gpus_per_member) == ("shared", ("0",), 0)
    assert "time-sliced" in one.note
    three = _plan([0, 1, 2], slots=2, gpus=1)  # 2 trainers fit, 4 with engines do not
    assert three.kind == "shared" and three.slot_devices == ("0", "1") and "MPS" in three.note
    with pytest.raises(PlacementError) as err:
        _plan([0, 1, 2], slots=2, mps=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith("launch.rollout_gpus_per_member (1) needs 4 GPUs")
    assert "but 3 are visible" in line and "launch.mps: true" in line
    with pytest.raises(PlacementError, match=r"needs 6 GPUs .* but 2 are visible"):
        _plan([0, 1], slots=3)  # not even the trainers fit


def test_auto_takes_spare_gpus_else_shares_with_async_and_is_colocated_with_sync() -> None:
    spare = _plan([0, 1, 2, 3], slots=2, engines="auto")
    assert (spare.kind, spare.engines_per_member, spare.slot_devices) == (
        "dedicated", 1, ("0,2", "1,3"),
    )  # fmt: skip
    two_ranks = _plan(list(range(4)), gpus=2, engines="auto")
    assert two_ranks.engines_per_member == 2 and two_ranks.slot_devices == ("0,1,2,3",)
    none_spare = _plan([0, 1], slots=2, engines="auto")
    assert (none_spare.kind, none_spare.engines_per_member) == ("shared", 1)
    assert _plan([0, 1, 2, 3], engines="auto", mode="sync").kind == "colocated"


def test_on_the_cpu_engines_are_processes_and_unknown_devices_are_assumed() -> None:
    cpu = _plan(None, slots=2, gpus=0, ranks=2, engines=2)
    assert (cpu.kind, cpu.slot_devices, cpu.engine_gpus_per_member) == ("cpu", ("", ""), 0)
    assert _plan(None, gpus=0, ranks=1, engines="auto").engines_per_member == 1
    assumed = _plan(None, slots=2)  # no nvidia-smi, no gpu_ids: as many as asked for
    assert assumed.kind == "dedicated" and assumed.slot_devices == ("0,2", "1,3")
    none = _plan([0], engines=0)
    assert (none.kind, none.slot_devices, none.note, none.env()) == (
        "colocated", (), "", {PLACEMENT_ENV: "colocated:0"},
    )  # fmt: skip


def test_visible_gpus_come_from_gpu_ids_then_cuda_visible_devices() -> None:
    assert visible_gpus([4, 5], {"CUDA_VISIBLE_DEVICES": "0"}) == [4, 5]
    assert visible_gpus(None, {"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert visible_gpus(None, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus(None, {"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}) is None  # uuids: unknown


def test_the_placement_reaches_the_launchers_slots_and_every_members_environment(
    tmp_path,
) -> None:
    launch = LaunchConfig(
        slots=2, gpus_per_member=1, gpu_ids=[0, 1, 2, 3], rollout_gpus_per_member=1,
        persistent_workers=False,
    )  # fmt: skip
    placement = placement_for(launch, "async")
    launcher = build_launcher(launch, tmp_path, ["true"], {}, HandAhead(), placement)
    assert launcher.slot_gpus == ["0,2", "1,3"]
    assert EnginePlacement.from_env(launcher.env) == EnginePlacement("dedicated", 1)
    slurm = LaunchConfig(backend="slurm", gpus_per_member=2, rollout_gpus_per_member="auto")
    p = placement_for(slurm, "async")
    assert (p.kind, p.engine_gpus_per_member) == ("dedicated", 2) and "2 + 2 GPUs" in p.note
    job = build_launcher(slurm, tmp_path, ["true"], {}, HandAhead(), p)
    assert job.gpus_per_member == 4  # the job asks Slurm for the trainer's and the engines'
    script = batch_script(
        job.backend.config, name="pbt-x", command=["x"], nproc=2, gpus_per_member=job.gpus_per_member,
        log_path=tmp_path / "log", workdir=tmp_path, env=job.env,
    )  # fmt: skip
    assert "#SBATCH --gpus-per-node=4" in script and f"{PLACEMENT_ENV}=dedicated:2" in script
    per_node = LaunchConfig(
        backend="slurm", gpus_per_member=2, rollout_gpus_per_member=2,
        slurm=SlurmConfig(nodes_per_member=2, gpus_per_node=1),
    )  # fmt: skip
    two = build_launcher(
        per_node, tmp_path, ["true"], {}, HandAhead(), placement_for(per_node, "sync")
    )
    assert (two.gpus_per_member, two.backend.config.gpus_per_node) == (4, 2)  # each node: 1 + 1


def test_a_campaign_that_cannot_place_its_engines_is_refused_before_its_folder_exists(
    tmp_path,
) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        "model: {name: builtin:tiny}\ntask: {name: builtin:addition}\n"
        "launch: {gpus_per_member: 1, gpu_ids: [0, 1, 2], slots: 2, mps: false,\n"
        "         rollout_gpus_per_member: auto}\nrollout: {mode: async, max_staleness: 1}\n"
    )
    with pytest.raises(PlacementError, match=r"needs 4 GPUs .* but 3 are visible"):
        Campaign.start(manifest, tmp_path / "campaign")
    assert not (tmp_path / "campaign").exists()
