"""``pbt stop`` (end a running campaign and its members) and ``pbt submit`` (the controller as a
Slurm job)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from pbt.config.errors import PbtError
from pbt.config.read.loader import read_manifest_file
from pbt.controller.campaign import STORE_FILENAME
from pbt.controller.lock import controller_running
from pbt.launch.processes import kill_orphan
from pbt.launch.slurm import SlurmQueue, cancel_campaign_jobs, live_jobs

STOP_WAIT_S = 180.0
"""How long ``pbt stop`` waits for the controller to cancel its members and exit."""


def stop(directory: Path, wait_s: float = STOP_WAIT_S) -> list[str]:
    """Interrupt the campaign's controller (as Ctrl-C would: it ends its members, and the
    campaign can be resumed), then end whatever member is still left. Lines saying what was
    done."""
    directory = Path(directory)
    if not (directory / STORE_FILENAME).exists():
        raise PbtError(f"{directory} holds no campaign (no {STORE_FILENAME}); give its directory")
    said = []
    who = controller_running(directory)
    if who is not None:
        said.append(_interrupt(who))
        deadline = time.monotonic() + wait_s
        while controller_running(directory) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if controller_running(directory) is not None:
            said.append(f"the controller still runs after {wait_s:g} s; ending its members")
        else:
            said.append("the controller stopped")
    else:
        said.append("no controller is running this campaign")
    ended = [p.name for p in (directory / "tasks").glob("*") if kill_orphan(p)]
    ended += [p.name for p in (directory / "workers").glob("slot*") if kill_orphan(p, names=p)]
    if ended:
        said.append(f"ended local members' processes: {', '.join(sorted(ended))}")
    if live_jobs(directory):
        cancelled = cancel_campaign_jobs(directory)
        said.append(
            f"cancelled Slurm jobs {', '.join(cancelled)}" if cancelled else "no Slurm job left"
        )
    said.append(f"continue it with: pbt resume {shlex.quote(str(directory))}")
    return said


def _interrupt(who: dict) -> str:
    pid, host, job = who.get("pid"), who.get("host"), who.get("slurm_job")
    if job and host != socket.gethostname():
        SlurmQueue().signal(str(job), "INT")
        return f"interrupted the controller (Slurm job {job} on {host})"
    if not isinstance(pid, int) or host not in (None, socket.gethostname()):
        raise PbtError(
            f"the controller runs on {host} (pid {pid}), not on this machine: stop it there "
            f"(pbt stop on {host}, or Ctrl-C in its terminal)"
        )
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return f"the controller (pid {pid}) had already ended"
    return f"interrupted the controller (pid {pid})"


def submit(manifest: Path, directory: Path, time_limit: str | None = None) -> tuple[str, Path]:
    """Write ``DIR/controller.sbatch`` for a controller job that starts the campaign (or
    resumes it, when the job is requeued or submitted again) and submit it: (job id, script)."""
    read = read_manifest_file(manifest)
    launch = read.manifest.launch
    if launch.backend != "slurm":
        raise PbtError(
            f"pbt submit runs the controller as a Slurm job that submits the members as jobs, "
            f"but {manifest} has launch.backend {launch.backend!r}: set launch.backend: slurm "
            "(or run the local backend inside one allocation: sbatch --wrap 'pbt run ...')"
        )
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    slurm = launch.slurm
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=pbt-controller-{directory.name}",
        f"#SBATCH --output={directory / 'controller.log'}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={Path.cwd()}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --requeue",
    ]
    for option, value in (
        ("partition", slurm.partition),
        ("account", slurm.account),
        ("qos", slurm.qos),
        ("time", time_limit),
    ):
        if value is not None:
            lines.append(f"#SBATCH --{option}={value}")
    pbt = f"{shlex.quote(sys.executable)} -m pbt.cli"
    quoted_dir = shlex.quote(str(directory))
    lines += [
        *slurm.setup,
        "export PYTHONUNBUFFERED=1",
        f"if [ -f {shlex.quote(str(directory / STORE_FILENAME))} ]; then",
        f"    exec {pbt} resume {quoted_dir}",
        "fi",
        f"exec {pbt} run {shlex.quote(str(Path(manifest).resolve()))} --dir {quoted_dir}",
    ]
    script = directory / "controller.sbatch"
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return SlurmQueue().submit(script), script


__all__ = ["stop", "submit"]
