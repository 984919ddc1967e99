"""The launcher a campaign's ``launch`` section asks for: local process groups or Slurm jobs,
one per task or long-lived workers, with the members' environment. No torch here."""

from __future__ import annotations

import os
from pathlib import Path

from pbt.config.campaign import LaunchConfig
from pbt.launch import slurm
from pbt.launch.handahead import HandAhead
from pbt.launch.local import LocalLauncher, member_command
from pbt.launch.persistent import PersistentLauncher


def member_env(launch: LaunchConfig) -> dict[str, str]:
    """Variables every member process gets: on the CPU, a share of the cores each (threads
    oversubscribed over members that share the cores slow every member down)."""
    if launch.gpus_per_member == 0 and "OMP_NUM_THREADS" not in os.environ:
        return {
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (launch.slots * launch.ranks)))
        }
    return {}


def build_launcher(
    launch: LaunchConfig,
    directory: Path,
    command: list[str] | None,
    env: dict[str, str],
    hand_ahead: HandAhead,
) -> LocalLauncher:
    """The launcher for ``launch`` in campaign ``directory``.

    Args:
        command: the member command in place of the default (``pbt.worker`` under torchrun,
            or under ``srun`` on Slurm); tests give a fake member.
        env: variables added to every member's environment.
        hand_ahead: where tasks handed ahead to long-lived workers are kept between calls.
    """
    kind, extra = LocalLauncher, {}
    if launch.persistent_workers:
        kind, extra = PersistentLauncher, {"workers_dir": directory / "workers"}
        if launch.backend != "slurm":
            extra["members_per_batch"] = launch.members_per_batch
    if launch.backend == "slurm":
        command = command or slurm.slurm_member_command()
        kind = slurm.SlurmPersistentLauncher if launch.persistent_workers else slurm.SlurmLauncher
        extra |= {"slurm": launch.slurm, "name": f"pbt-{directory.resolve().name}"}
    limit = launch.memory_limit_gib
    return kind(
        command or member_command(),
        **extra,
        slots=launch.slots,
        gpus_per_member=launch.gpus_per_member,
        gpu_ids=launch.gpu_ids,
        members_per_gpu=launch.members_per_gpu,
        heartbeat_timeout_s=launch.heartbeat_timeout_s,
        task_timeout_s=launch.task_timeout_s,
        env=env,
        campaign_dir=directory,
        memory_limit_bytes=None if limit is None else int(limit * 2**30),
        hand_ahead=hand_ahead,
    )
