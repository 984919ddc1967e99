"""Where a member's process group runs: the seam between a launcher and what starts, watches
and stops its groups (:class:`ProcessBackend`), and the backend of this machine
(:class:`LocalBackend`). No torch here.

A launcher decides what runs when: the slots, the queue, the task files, heartbeats and
timeouts, long-lived workers and the hand-ahead (:mod:`pbt.launch.local`,
:mod:`pbt.launch.persistent`). Its backend decides how a group runs: it starts one from a
:class:`GroupSpec` and returns a :class:`~pbt.launch.processes.ProcessGroup` to poll, says
whether a started group still waits for resources, stops groups, leaves the record a resumed
controller reads, adds what its exit code cannot say to a failed outcome, and deals with what a
crashed controller left. The local backend runs each group as a session of its own on this
machine; :class:`~pbt.launch.slurm.SlurmBackend` submits it as a Slurm job. Any launcher runs
on any backend; a third backend (Ray, say) is one more class.
"""

from __future__ import annotations

import os
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from pbt.launch.attempt import Outcome
from pbt.launch.processes import ProcessGroup, kill_groups, kill_orphan, memory_limiter
from pbt.protocol.controller import CAMPAIGN_ENV, CONTROLLER_ENV, controller_token


def member_command() -> list[str]:
    """The default member command on this machine: ``pbt.worker`` under torchrun, one node,
    the rank count filled in by the launcher (``{nproc}``). ``--standalone``: the agent binds
    its rendezvous store on port 0 and its ranks read the port back from it, so two campaigns
    on one machine never race for a port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node={nproc}",
        "-m",
        "pbt.worker",
    ]


@dataclass(frozen=True)
class GroupSpec:
    """One process group to start: a task attempt's, or a long-lived worker's."""

    command: list[str]
    """The program and its arguments, the task's path (or ``--serve FOLDER``) last; ``{nproc}``
    and ``{port}`` (and on Slurm ``{nnodes}``, ``{endpoint}``, ``{job}``) are the backend's to
    fill in."""
    nproc: int
    """Ranks in the group."""
    port: int
    """A rendezvous port free when chosen, for a command that names ``{port}`` (else 0)."""
    log_path: Path
    """Receives the group's stdout and stderr."""
    gpus: str
    """``CUDA_VISIBLE_DEVICES`` of the slot ("" on the CPU), where the launcher places GPUs."""
    gpus_per_member: int
    """GPUs the group needs, where a scheduler places them."""
    env: dict[str, str]
    """Variables added to the members' environment."""
    campaign_dir: Path | None = None
    """The campaign, named in every local process's environment (``PBT_CAMPAIGN``)."""
    memory_limit_bytes: int | None = None
    """``RLIMIT_DATA`` of every local process of the group; None: no limit."""


class ProcessBackend(ABC):
    """How a launcher's process groups are started, watched and stopped."""

    name: str
    """The ``launch.backend`` value that selects this backend."""
    poll_s: float | None = None
    """Seconds between a launcher's checks that suit this backend; None: the launcher's own."""

    @abstractmethod
    def member_command(self) -> list[str]:
        """The default member command (``pbt.worker`` under torchrun) on this backend."""

    @abstractmethod
    def start(self, spec: GroupSpec) -> ProcessGroup:
        """Start the group ``spec`` describes."""

    @abstractmethod
    def record(self, group: ProcessGroup, folder: Path) -> None:
        """Leave ``group``'s id in ``folder`` (a task's, or a worker slot's): it outlives this
        controller, and a resumed one reads it (:meth:`take_over`, :meth:`end_orphan_worker`)."""

    @abstractmethod
    def stop(self, groups: list[ProcessGroup]) -> list[int]:
        """End every process of each group, and wait for them; their exit codes."""

    @abstractmethod
    def take_over(self, task_dir: Path) -> str | None:
        """What a crashed controller left running for the task in ``task_dir``: the id of a
        group to adopt (:meth:`adopt`), or None once nothing of it runs any more."""

    @abstractmethod
    def end_orphan_worker(self, folder: Path) -> None:
        """End the long-lived worker a crashed controller left in slot folder ``folder``."""

    def adopt(self, group_id: str, task_dir: Path) -> ProcessGroup:
        """The group ``group_id`` that :meth:`take_over` named for ``task_dir``, to watch."""
        raise ValueError(f"{self.name} process groups are never adopted ({group_id}, {task_dir})")

    def waiting(self, group: ProcessGroup) -> bool:
        """Whether ``group`` waits for resources (a queued job): its clocks have not started."""
        return False

    def explain(self, group: ProcessGroup, outcome: Outcome) -> Outcome:
        """``outcome`` of a group that ended by itself, with what the backend knows beyond its
        exit code (a scheduler's time or memory limit, a cancellation)."""
        return outcome


class LocalBackend(ProcessBackend):
    """Each group a session of its own on this machine, so that one ``os.killpg`` ends it.

    Every process carries the campaign and the controller in its environment
    (:mod:`pbt.protocol.controller`): a long-lived worker ends soon after its controller dies,
    and a resumed controller ends whatever its predecessor left running.
    """

    name = "local"

    def member_command(self) -> list[str]:
        return member_command()

    def start(self, spec: GroupSpec) -> subprocess.Popen[bytes]:
        """The command, ``{nproc}`` and ``{port}`` filled in, on the slot's GPUs."""
        argv = [
            a.replace("{nproc}", str(spec.nproc)).replace("{port}", str(spec.port))
            for a in spec.command
        ]
        env = {**os.environ, **spec.env, "CUDA_VISIBLE_DEVICES": spec.gpus}
        env.pop("MLFLOW_RUN_ID", None)  # an inherited run id would hijack every member's run
        env[CONTROLLER_ENV] = controller_token()
        env.pop(CAMPAIGN_ENV, None)
        if spec.campaign_dir is not None:
            env[CAMPAIGN_ENV] = str(spec.campaign_dir)
        env.setdefault("PYTHONUNBUFFERED", "1")  # the log shows progress as it happens
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        limit = spec.memory_limit_bytes
        with open(spec.log_path, "wb") as log:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=None if limit is None else memory_limiter(limit),
            )

    def record(self, group: ProcessGroup, folder: Path) -> None:
        (Path(folder) / "pgid").write_text(str(group.pid))

    def stop(self, groups: list[ProcessGroup]) -> list[int]:
        return kill_groups(groups)

    def take_over(self, task_dir: Path) -> str | None:
        """Local groups are ended, never adopted: a resumed controller cannot wait on a
        process it did not start."""
        kill_orphan(task_dir)
        return None

    def end_orphan_worker(self, folder: Path) -> None:
        kill_orphan(folder, names=folder)
