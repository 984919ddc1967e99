"""The launcher a campaign's ``launch`` section asks for: a process group per task or long-lived
workers (``persistent_workers``), on this machine or as Slurm jobs (``backend``), with the
members' environment. No torch here."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from pbt.config.sections.campaign import LaunchConfig, SlurmConfig
from pbt.launch.backend import LocalBackend, ProcessBackend
from pbt.launch.handahead import HandAhead
from pbt.launch.local import LocalLauncher
from pbt.launch.persistent import PersistentLauncher
from pbt.launch.placement import COLOCATED, Placement
from pbt.launch.slurm import SlurmBackend


def member_env(launch: LaunchConfig) -> dict[str, str]:
    """Variables every member process gets: on the CPU, a share of the cores each (threads
    oversubscribed over members that share the cores slow every member down)."""
    if launch.gpus_per_member == 0 and "OMP_NUM_THREADS" not in os.environ:
        return {
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (launch.slots * launch.ranks)))
        }
    return {}


def build_backend(
    launch: LaunchConfig, directory: Path, slurm: SlurmConfig | None = None
) -> ProcessBackend:
    """What runs the process groups of the campaign in ``directory`` (``launch.backend``);
    ``slurm`` in place of ``launch.slurm`` (with the engine GPUs added, say)."""
    if launch.backend == "local":
        return LocalBackend()
    if launch.backend == "slurm":
        return SlurmBackend(slurm or launch.slurm, name=f"pbt-{directory.resolve().name}")
    raise ValueError(f"launch.backend ({launch.backend!r}) names no backend; use local or slurm")


def build_launcher(
    launch: LaunchConfig,
    directory: Path,
    command: list[str] | None,
    env: dict[str, str],
    hand_ahead: HandAhead,
    placement: Placement = COLOCATED,
    members_per_batch: int = 1,
) -> LocalLauncher:
    """The launcher for ``launch`` in campaign ``directory``.

    Args:
        command: the member command in place of the backend's default (``pbt.worker`` under
            torchrun, or under ``srun`` on Slurm); tests give a fake member.
        env: variables added to every member's environment.
        hand_ahead: where tasks handed ahead to long-lived workers are kept between calls.
        placement: where the members' rollout engines run (:mod:`pbt.launch.placement`): each
            slot's GPUs, and on Slurm the engine GPUs each job asks for.
        members_per_batch: tasks a long-lived worker runs together (the manifest's
            :attr:`~pbt.config.Manifest.worker_batch`).
    """
    gpus, config = launch.gpus_per_member, launch.slurm
    if launch.backend == "slurm":
        config, gpus = _with_engine_gpus(launch, placement.engine_gpus_per_member)
    backend = build_backend(launch, directory, config)
    limit = launch.memory_limit_gib
    common = {
        "slots": launch.slots,
        "gpus_per_member": gpus,
        "gpu_ids": launch.gpu_ids,
        "members_per_gpu": launch.members_per_gpu,
        "heartbeat_timeout_s": launch.heartbeat_timeout_s,
        "task_timeout_s": launch.task_timeout_s,
        "env": {**env, **placement.env()},
        "campaign_dir": directory,
        "memory_limit_bytes": None if limit is None else int(limit * 2**30),
        "hand_ahead": hand_ahead,
        "backend": backend,
    }
    command = command or backend.member_command()
    if launch.persistent_workers:
        launcher = PersistentLauncher(
            command, workers_dir=directory / "workers", members_per_batch=members_per_batch,
            **common,
        )  # fmt: skip
    else:
        launcher = LocalLauncher(command, **common)
    if placement.slot_devices:
        launcher.slot_gpus = list(placement.slot_devices)  # trainer GPUs, then engine GPUs
    return launcher


def _with_engine_gpus(launch: LaunchConfig, engine_gpus: int) -> tuple[SlurmConfig, int]:
    """The Slurm section and GPUs per member job with the member's engine GPUs added (each
    node's share beside its trainer GPUs, which Slurm lists first)."""
    config = launch.slurm
    if not engine_gpus or not launch.gpus_per_member:
        return config, launch.gpus_per_member
    nodes = config.nodes_per_member
    if config.gpus_per_node is not None:
        config = replace(config, gpus_per_node=config.gpus_per_node + engine_gpus // nodes)
    return config, launch.gpus_per_member + engine_gpus
