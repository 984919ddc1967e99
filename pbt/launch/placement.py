"""Where a member's dedicated rollout engines run (``launch.rollout_gpus_per_member``): on GPUs
of their own, as processes of their own on their trainers' GPUs, or on the CPU. No torch here.

The launcher gives each slot one ``CUDA_VISIBLE_DEVICES``. With ``dedicated`` engines it lists
the slot's trainer GPUs first and its engine GPUs after them, so torchrun's ranks take logical
devices ``0 .. ranks-1`` as always and the engine of local rank ``r`` takes ``ranks + r``; the
same order serves a Slurm job, whose GPUs the scheduler lists. Trainer GPUs are split among the
slots as before (``members_per_gpu`` slots share a group); engine GPUs come after all of
them, one group's per slot group. Every process of the member learns the placement from
:data:`~pbt.protocol.engines.PLACEMENT_ENV`.

The rules (:func:`plan_placement`), for ``E`` engines a member (one per trainer rank), ``G``
GPUs a member and ``S`` slot groups:

- no GPUs (``gpus_per_member: 0``): the engines are processes on the CPU;
- ``S x (G + E)`` GPUs visible: ``dedicated``;
- fewer, but the trainers' ``S x G`` fit, and MPS is on or there is one GPU: ``shared`` (each
  engine its own process on its rank's GPU, their kernels overlapping under MPS);
- else a refusal, in one line, with what would fit;
- ``auto``: ``E`` = one per trainer rank with ``rollout.mode: async`` (AgileRL Arena's
  ``rollout_engines_per_agent: auto``: the GPUs the trainers leave over), dedicated where the
  spare GPUs hold them all, else shared; with ``mode: sync`` no engine (colocated), since an
  engine in lockstep only takes turns with its trainer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from pbt.config.errors import PbtError
from pbt.config.sections.campaign import LaunchConfig
from pbt.config.sections.rollout import engine_count
from pbt.protocol.engines import PLACEMENT_ENV, EnginePlacement


class PlacementError(PbtError):
    """The engines asked for cannot be placed on the devices there are; one line."""


@dataclass(frozen=True, slots=True)
class Placement:
    """The engines of every slot and where they run."""

    kind: str
    """``colocated``, ``dedicated``, ``shared`` or ``cpu`` (:data:`~pbt.protocol.engines.PLACEMENTS`)."""
    engines_per_member: int
    """Engines of each member, ``auto`` resolved (0: colocated)."""
    slot_devices: tuple[str, ...]
    """``CUDA_VISIBLE_DEVICES`` of each slot: its trainer GPUs, then its engine GPUs."""
    note: str
    """The placement in one line, for ``pbt check`` and the controller's log."""

    @property
    def engine_gpus_per_member(self) -> int:
        """GPUs a member's engines hold beside its trainer's (0 unless ``dedicated``)."""
        return self.engines_per_member if self.kind == "dedicated" else 0

    def env(self) -> dict[str, str]:
        """What every process of a member is told (:data:`PLACEMENT_ENV`)."""
        return {PLACEMENT_ENV: EnginePlacement(self.kind, self.engines_per_member).to_env()}


COLOCATED = Placement("colocated", 0, (), "")
"""No engines: each slot's devices are the launcher's own split."""


def placement_for(launch: LaunchConfig, mode: str) -> Placement:
    """The placement of a campaign's ``launch`` section with ``rollout.mode`` ``mode``, on the
    GPUs this machine shows (local) or that each job asks for (Slurm).

    Raises:
        PlacementError: as :func:`plan_placement`.
    """
    engines = launch.rollout_gpus_per_member
    if engines == 0:
        return COLOCATED
    if launch.backend == "slurm":
        return slurm_placement(
            gpus_per_member=launch.gpus_per_member, ranks=launch.ranks, engines=engines, mode=mode
        )
    return plan_placement(
        devices=visible_gpus(launch.gpu_ids) if launch.gpus_per_member else None,
        slots=launch.slots, gpus_per_member=launch.gpus_per_member,
        members_per_gpu=launch.members_per_gpu, ranks=launch.ranks, engines=engines, mode=mode,
        mps=launch.mps,
    )  # fmt: skip


def visible_gpus(
    gpu_ids: list[int] | None, environ: Mapping[str, str] | None = None
) -> list[int] | None:
    """The GPUs a local campaign may use: ``launch.gpu_ids``, else ``CUDA_VISIBLE_DEVICES``
    (numeric ids), else those ``nvidia-smi`` lists; None where none of them tells."""
    if gpu_ids is not None:
        return list(gpu_ids)
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        items = [item.strip() for item in value.split(",") if item.strip()]
        return [int(item) for item in items] if all(i.isdigit() for i in items) else None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not all(line.isdigit() for line in lines):
        return None
    return [int(line) for line in lines]


def plan_placement(
    *,
    devices: list[int] | None,
    slots: int,
    gpus_per_member: int,
    members_per_gpu: int,
    ranks: int,
    engines: int | str,
    mode: str,
    mps: bool,
) -> Placement:
    """Where each slot's trainer and engines run (see the module for the rules).

    Args:
        devices: the GPU ids there are (:func:`visible_gpus`); None: unknown, assumed to be as
            many as asked for.
        slots, gpus_per_member, members_per_gpu: the launch's slot plan.
        ranks: processes of a member's torchrun group.
        engines: ``launch.rollout_gpus_per_member`` (a count or ``"auto"``).
        mode: ``rollout.mode``.
        mps: ``launch.mps``: GPUs may be shared side by side under MPS.

    Raises:
        PlacementError: the engines fit neither on GPUs of their own nor beside the trainers.
    """
    engines = engine_count(engines, ranks, mode)
    if engines == 0:
        return COLOCATED
    if not gpus_per_member:
        return Placement(
            "cpu", engines, ("",) * slots, f"rollout engines: {engines} a member, each its own "
            "process on the CPU",
        )  # fmt: skip
    groups = -(-slots // max(1, members_per_gpu))
    trainers, wanted = groups * gpus_per_member, groups * engines
    ids = list(range(trainers + wanted)) if devices is None else list(devices)
    if len(ids) >= trainers + wanted:
        return _dedicated(ids, slots, gpus_per_member, members_per_gpu, engines)
    if len(ids) >= trainers and (mps or len(ids) == 1):
        how = "under MPS" if mps else "time-sliced (launch.mps is false)"
        return Placement(
            "shared", engines, _slot_lists(ids, slots, gpus_per_member, members_per_gpu),
            f"rollout engines: {engines} a member, each its own process on its trainer's GPU "
            f"{how}; {len(ids)} GPU(s) visible, {trainers + wanted} would give each engine its "
            "own",
        )  # fmt: skip
    raise PlacementError(
        f"launch.rollout_gpus_per_member ({engines}) needs {trainers + wanted} GPUs ({groups} "
        f"slot group(s) x ({gpus_per_member} trainer + {engines} engine)) but {len(ids)} are "
        "visible; list more in launch.gpu_ids, lower launch.slots, or set launch.mps: true to "
        "run each engine beside its trainer"
    )


def _dedicated(
    ids: list[int], slots: int, gpus: int, members_per_gpu: int, engines: int
) -> Placement:
    groups = -(-slots // max(1, members_per_gpu))
    trainer_ids, engine_ids = ids[: groups * gpus], ids[groups * gpus :]
    devices = []
    for slot in range(slots):
        group = slot // max(1, members_per_gpu)
        own = [*trainer_ids[group * gpus : (group + 1) * gpus]]
        own += engine_ids[group * engines : (group + 1) * engines]
        devices.append(",".join(str(g) for g in own))
    shown = "; ".join(f"slot {i}: {d}" for i, d in enumerate(devices))
    note = (
        f"rollout engines: {engines} a member on GPUs of their own (CUDA_VISIBLE_DEVICES, "
        f"{gpus} trainer GPU(s) first: {shown})"
    )
    return Placement("dedicated", engines, tuple(devices), note)


def _slot_lists(ids: list[int], slots: int, gpus: int, members_per_gpu: int) -> tuple[str, ...]:
    per = max(1, members_per_gpu)
    return tuple(
        ",".join(str(g) for g in ids[(s // per) * gpus : (s // per + 1) * gpus])
        for s in range(slots)
    )


def slurm_placement(
    *, gpus_per_member: int, ranks: int, engines: int | str, mode: str
) -> Placement:
    """On Slurm each member job asks for its engines' GPUs beside its trainers' (``auto``:
    one per trainer rank with async rollouts); Slurm lists them in that order."""
    engines = engine_count(engines, ranks, mode)
    if engines == 0:
        return COLOCATED
    if not gpus_per_member:
        return Placement("cpu", engines, (), f"rollout engines: {engines} a member, each its own "
                         "process on the CPU of the member's job")  # fmt: skip
    return Placement(
        "dedicated", engines, (), f"rollout engines: {engines} a member on GPUs of their own: "
        f"each job asks Slurm for {gpus_per_member} + {engines} GPUs",
    )  # fmt: skip
