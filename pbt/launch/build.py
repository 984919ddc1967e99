"""The launcher a campaign's ``launch`` section asks for: a process group per task or long-lived
workers (``persistent_workers``), on this machine or as Slurm jobs (``backend``), with the
members' environment. No torch here."""

from __future__ import annotations

import os
from pathlib import Path

from pbt.config.campaign import LaunchConfig
from pbt.launch.backend import LocalBackend, ProcessBackend
from pbt.launch.handahead import HandAhead
from pbt.launch.local import LocalLauncher
from pbt.launch.persistent import PersistentLauncher
from pbt.launch.slurm import SlurmBackend


def member_env(launch: LaunchConfig) -> dict[str, str]:
    """Variables every member process gets: on the CPU, a share of the cores each (threads
    oversubscribed over members that share the cores slow every member down)."""
    if launch.gpus_per_member == 0 and "OMP_NUM_THREADS" not in os.environ:
        return {
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (launch.slots * launch.ranks)))
        }
    return {}


def build_backend(launch: LaunchConfig, directory: Path) -> ProcessBackend:
    """What runs the process groups of the campaign in ``directory`` (``launch.backend``)."""
    if launch.backend == "local":
        return LocalBackend()
    if launch.backend == "slurm":
        return SlurmBackend(launch.slurm, name=f"pbt-{directory.resolve().name}")
    raise ValueError(f"launch.backend ({launch.backend!r}) names no backend; use local or slurm")


def build_launcher(
    launch: LaunchConfig,
    directory: Path,
    command: list[str] | None,
    env: dict[str, str],
    hand_ahead: HandAhead,
) -> LocalLauncher:
    """The launcher for ``launch`` in campaign ``directory``.

    Args:
        command: the member command in place of the backend's default (``pbt.worker`` under
            torchrun, or under ``srun`` on Slurm); tests give a fake member.
        env: variables added to every member's environment.
        hand_ahead: where tasks handed ahead to long-lived workers are kept between calls.
    """
    backend = build_backend(launch, directory)
    limit = launch.memory_limit_gib
    common = {
        "slots": launch.slots,
        "gpus_per_member": launch.gpus_per_member,
        "gpu_ids": launch.gpu_ids,
        "members_per_gpu": launch.members_per_gpu,
        "heartbeat_timeout_s": launch.heartbeat_timeout_s,
        "task_timeout_s": launch.task_timeout_s,
        "env": env,
        "campaign_dir": directory,
        "memory_limit_bytes": None if limit is None else int(limit * 2**30),
        "hand_ahead": hand_ahead,
        "backend": backend,
    }
    command = command or backend.member_command()
    if launch.persistent_workers:
        return PersistentLauncher(command, workers_dir=directory / "workers", **common)
    return LocalLauncher(command, **common)
