"""Members as Slurm jobs: the backend that makes a launcher's process groups jobs
(:class:`SlurmBackend`), the batch script, the queue, and job states as outcomes. No torch here.

Slurm is driven through its own commands, which every cluster has and which keep their text
formats across versions: ``sbatch --parsable`` submits, one ``squeue --me --states=all`` per
poll reads every job of the campaign, ``scontrol show job`` gives an ended job's exit code (and
``sacct``, where accounting exists, one that ``scontrol`` has forgotten), ``scancel`` stops.

Each member task is one job. Its script runs the ``launch.slurm.setup`` lines, then ``srun``
starts one torchrun agent per node (``tasks_per_node`` per node where one host stands in for
several): ``--nnodes`` agents meet over c10d at the allocation's first node, on a port derived
from the job id, with the job id as the rendezvous id. The workers read and write the same
task, result, heartbeat and fault files as on the local backend, in the campaign folder, which
must be on a file system every node sees.

A job's record, ``job.json`` beside its task (or in a long-lived worker's slot folder), holds
its id and the state the controller last saw, with Slurm's reason while it waits: ``pbt
status`` shows it, and a resumed controller finds its jobs there.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pbt.config.errors import PbtError
from pbt.config.sections.campaign import SlurmConfig
from pbt.launch.attempt import Outcome
from pbt.launch.backend import GroupSpec, ProcessBackend
from pbt.launch.processes import JOB_CANCEL_WAIT_S, ProcessGroup
from pbt.protocol.files import read_json, write_json_atomic
from pbt.protocol.messages import RESULT_FILE, ResultMessage

JOB_FILE = "job.json"
LIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                  "RESIZING", "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED",
                  "RESV_DEL_HOLD", "STOPPED"})  # fmt: skip
"""States of a job that has not ended (``COMPLETING``: its processes are being cleaned up)."""
WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
"""States of a job that holds no running member yet: its heartbeat and time are not counted."""
STATUS_OF_STATE = {
    "TIMEOUT": "timeout",
    "OUT_OF_MEMORY": "out_of_memory",
    "NODE_FAIL": "node_fail",
    "PREEMPTED": "preempted",
    "CANCELLED": "cancelled",
    "BOOT_FAIL": "node_fail",
    "DEADLINE": "timeout",
}
"""An ended job's state -> the attempt's outcome, where the state says more than its exit code
(``COMPLETED`` and ``FAILED`` are read from the task's files and exit code as on the local
backend)."""
COMMAND_TIMEOUT_S = 60.0
_EXIT = re.compile(r"\bExitCode=(\d+):(\d+)")
_FIELD = re.compile(r"\b(JobState|Reason)=(\S+)")


@dataclass(frozen=True)
class JobState:
    """What Slurm says of one job."""

    state: str
    """``PENDING``, ``RUNNING``, ``COMPLETED``, ``TIMEOUT``, ...; ``UNKNOWN`` once Slurm has
    forgotten the job."""
    reason: str = ""
    """Why a pending job waits (``Resources``, ``Priority``, ...)."""
    exit_code: int | None = None
    signal: int | None = None

    @property
    def ended(self) -> bool:
        return self.state not in LIVE

    @property
    def returncode(self) -> int:
        """As ``subprocess`` reports it: ``-signal`` when a signal ended the script."""
        if self.signal:
            return -self.signal
        if self.exit_code is not None:
            return self.exit_code if self.exit_code or self.state == "COMPLETED" else 1
        return 0 if self.state == "COMPLETED" else 1


def _run(argv: list[str], what: str) -> str:
    """Run one Slurm command; its stdout, or a PbtError that quotes Slurm's own message.

    The job variables of an enclosing allocation (a controller that runs as a job itself) are
    left out: ``sbatch`` would carry them into the member's job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    if "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, env=env
        )
    except FileNotFoundError:
        raise PbtError(
            f"{argv[0]} is not on PATH: launch.backend slurm needs Slurm's commands (sbatch, "
            "squeue, scancel) where the controller runs; run it on a login node, or use "
            "launch.backend: local"
        ) from None
    except subprocess.TimeoutExpired:
        raise PbtError(
            f"{argv[0]} did not answer in {COMMAND_TIMEOUT_S:g} s while {what}"
        ) from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise PbtError(
            f"{argv[0]} failed while {what}: {message[-1] if message else done.returncode}"
        )
    return done.stdout


class SlurmQueue:
    """The campaign's jobs as Slurm sees them, read at most once per ``poll_s`` for all."""

    def __init__(self, poll_s: float = 2.0) -> None:
        self.poll_s = poll_s
        self._states: dict[str, JobState] = {}
        self._read_at = float("-inf")
        self._ended: dict[str, JobState] = {}

    def submit(self, script: Path) -> str:
        """Submit a batch script; its job id."""
        out = _run(["sbatch", "--parsable", str(script)], f"submitting {script}")
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise PbtError(f"sbatch answered {out.strip()!r} for {script}, not a job id")
        self._read_at = float("-inf")  # the next look sees the new job
        return job_id

    def state(self, job_id: str) -> JobState:
        """The job's state, from a look at the queue no older than ``poll_s``."""
        if job_id in self._ended:
            return self._ended[job_id]
        if time.monotonic() - self._read_at >= self.poll_s:
            self.refresh()
        state = self._states.get(job_id)
        if state is not None and not state.ended:
            return state
        state = self._final(job_id, state)
        if state.ended:
            self._ended[job_id] = state
        return state

    def refresh(self) -> None:
        out = _run(
            ["squeue", "--me", "--noheader", "--states=all", "--format=%i|%T|%r"],
            "reading the queue",
        )
        states = {}
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0].isdigit():
                states[parts[0]] = JobState(parts[1], "" if parts[2] == "None" else parts[2])
        self._states, self._read_at = states, time.monotonic()

    def _final(self, job_id: str, seen: JobState | None) -> JobState:
        """An ended job's state with its exit code, from ``scontrol`` or else ``sacct``."""
        with contextlib.suppress(PbtError):
            text = _run(["scontrol", "show", "job", "-o", job_id], f"reading job {job_id}")
            fields = dict(_FIELD.findall(text))
            code = _EXIT.search(text)
            if "JobState" in fields:
                reason = fields.get("Reason", "None")
                return JobState(
                    fields["JobState"],
                    reason="" if reason == "None" else reason,
                    exit_code=int(code.group(1)) if code else None,
                    signal=int(code.group(2)) if code else None,
                )
        if shutil.which("sacct"):
            with contextlib.suppress(PbtError):
                text = _run(
                    ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode"],
                    f"reading job {job_id}",
                )
                line = text.strip().splitlines()[0] if text.strip() else ""
                if "|" in line:
                    state, code = line.split("|", 1)
                    exit_code, _, sig = code.partition(":")
                    return JobState(
                        state.split()[0],
                        exit_code=int(exit_code) if exit_code.isdigit() else None,
                        signal=int(sig) if sig.isdigit() else None,
                    )
        if seen is not None and seen.ended:
            return seen
        return JobState("UNKNOWN")

    def signal(self, job_id: str, name: str) -> None:
        """Send signal ``name`` (e.g. ``INT``) to every process of the job."""
        _run(["scancel", f"--signal={name}", "--full", job_id], f"signalling job {job_id}")

    def cancel(self, job_ids: list[str]) -> None:
        if job_ids:
            with contextlib.suppress(PbtError):  # already gone is fine
                _run(["scancel", *job_ids], f"cancelling jobs {', '.join(job_ids)}")
            self._read_at = float("-inf")


class SlurmJob:
    """A submitted job, with the part of :class:`subprocess.Popen`'s interface the launchers
    use: ``poll``, ``wait`` and a ``pid`` (the job id)."""

    def __init__(self, queue: SlurmQueue, job_id: str, record: Path | None = None) -> None:
        self.queue, self.job_id, self.record = queue, job_id, record
        self.pid = int(job_id)
        self._seen: tuple[str, str] | None = None

    def state(self) -> JobState:
        state = self.queue.state(self.job_id)
        if self.record is not None and (state.state, state.reason) != self._seen:
            self._seen = (state.state, state.reason)
            with contextlib.suppress(OSError):
                old = read_json(self.record) or {}
                write_json_atomic(
                    self.record,
                    old | {"job_id": self.job_id, "state": state.state, "reason": state.reason},
                )
        return state

    @property
    def waiting(self) -> bool:
        return self.state().state in WAITING

    def poll(self) -> int | None:
        state = self.state()
        return state.returncode if state.ended else None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"job {self.job_id}", timeout or 0.0)
            time.sleep(min(0.5, self.queue.poll_s))
        return code

    def cancel(self) -> None:
        self.queue.cancel([self.job_id])


def read_job(folder: Path) -> dict[str, Any] | None:
    """The job record in ``folder`` (a task's or a worker slot's), or None."""
    record = read_json(Path(folder) / JOB_FILE)
    return record if record and str(record.get("job_id", "")).isdigit() else None


def batch_script(
    config: SlurmConfig,
    *,
    name: str,
    command: list[str],
    nproc: int,
    gpus_per_member: int,
    log_path: Path,
    workdir: Path,
    env: dict[str, str],
    time_limit: str | None = None,
) -> str:
    """The sbatch script of one member task (or long-lived worker).

    ``command`` is the program run by each agent, with ``{nproc}`` (ranks per agent),
    ``{nnodes}`` (agents), ``{endpoint}`` (``host:port`` of the rendezvous), ``{port}`` and
    ``{job}`` filled in when the job runs.
    """
    agents = config.nodes_per_member * config.tasks_per_node
    per_agent = max(1, nproc // agents)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --output={log_path}",
             "#SBATCH --open-mode=append", f"#SBATCH --chdir={workdir}",
             f"#SBATCH --nodes={config.nodes_per_member}",
             f"#SBATCH --ntasks-per-node={config.tasks_per_node}"]  # fmt: skip
    if gpus_per_member:
        per_node = config.gpus_per_node or gpus_per_member // config.nodes_per_member
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    for option, value in (
        ("partition", config.partition),
        ("account", config.account),
        ("qos", config.qos),
        ("time", time_limit or config.time),
        ("cpus-per-task", config.cpus_per_task),
        ("mem", config.mem),
        ("constraint", config.constraint),
    ):
        if value is not None:
            lines.append(f"#SBATCH --{option}={value}")
    lines += [f"#SBATCH {option}" for option in config.extra_sbatch]
    lines += ["set -eo pipefail", *config.setup, "unset MLFLOW_RUN_ID"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    if not gpus_per_member:
        lines.append('export CUDA_VISIBLE_DEVICES=""')
    lines += [
        'PBT_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "PBT_PORT=$((20000 + SLURM_JOB_ID % 20000))",
        'PBT_ENDPOINT="$PBT_HEAD:$PBT_PORT"',
        f"PBT_NNODES={agents}",
        f"PBT_NPROC={per_agent}",
        f'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: {agents} torchrun agent(s) x '
        f'{per_agent} rank(s), rendezvous $PBT_ENDPOINT"',
        "srun --kill-on-bad-exit=1 --ntasks-per-node="
        f"{config.tasks_per_node} {' '.join(_shell_arg(a) for a in command)}",
    ]
    return "\n".join(lines) + "\n"


_PLACEHOLDERS = {"{nproc}": "PBT_NPROC", "{nnodes}": "PBT_NNODES", "{endpoint}": "PBT_ENDPOINT",
                 "{port}": "PBT_PORT", "{job}": "SLURM_JOB_ID"}  # fmt: skip


def _shell_arg(arg: str) -> str:
    """One argument for the script: literal text quoted, placeholders as its variables."""
    parts = re.split("(" + "|".join(map(re.escape, _PLACEHOLDERS)) + ")", arg)
    return "".join(
        f'"${_PLACEHOLDERS[p]}"' if p in _PLACEHOLDERS else shlex.quote(p) for p in parts if p
    )


def slurm_member_command() -> list[str]:
    """The default member command on Slurm: ``pbt.worker`` under torchrun, one agent per node,
    c10d rendezvous at the allocation's first node."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes={nnodes}",
        "--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint={endpoint}",
        "--rdzv_id={job}",
        "-m",
        "pbt.worker",
    ]


class SlurmBackend(ProcessBackend):
    """Each process group a Slurm job: a member task's (with :class:`LocalLauncher
    <pbt.launch.local.LocalLauncher>`) or a long-lived worker's (with
    :class:`PersistentLauncher <pbt.launch.persistent.PersistentLauncher>`, one job per slot).

    Args:
        config: the campaign's ``launch.slurm``.
        name: every job's ``--job-name``.
    """

    name = "slurm"

    def __init__(self, config: SlurmConfig, name: str) -> None:
        self.config, self.job_name = config, name
        self.queue = SlurmQueue(config.poll_s)
        self.poll_s = min(1.0, config.poll_s)

    def member_command(self) -> list[str]:
        return slurm_member_command()

    def start(self, spec: GroupSpec) -> SlurmJob:
        """Submit the job: ``spec``'s command, ``spec.nproc`` ranks in all; Slurm gives it its
        GPUs."""
        log_path = Path(spec.log_path).resolve()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        script = batch_script(
            self.config,
            name=self.job_name,
            command=spec.command,
            nproc=spec.nproc,
            gpus_per_member=spec.gpus_per_member,
            log_path=log_path,
            workdir=Path.cwd(),
            env={"PYTHONUNBUFFERED": "1", **spec.env},
        )
        path = log_path.with_suffix(".sbatch")
        path.write_text(script, encoding="utf-8")
        return SlurmJob(self.queue, self.queue.submit(path))  # its record is placed by record()

    def record(self, group: ProcessGroup, folder: Path) -> None:
        job = _job(group)
        job.record = Path(folder) / JOB_FILE
        write_json_atomic(job.record, {"job_id": job.job_id, "state": "PENDING", "reason": "",
                                       "submitted": time.time()})  # fmt: skip

    def stop(self, groups: list[ProcessGroup]) -> list[int]:
        """Cancel the jobs that have not ended, and wait for each (at most
        ``JOB_CANCEL_WAIT_S``; one that outlasts it counts as killed)."""
        jobs = [_job(group) for group in groups]
        self.queue.cancel([job.job_id for job in jobs if job.poll() is None])
        codes = []
        for job in jobs:
            try:
                codes.append(job.wait(JOB_CANCEL_WAIT_S))
            except subprocess.TimeoutExpired:
                codes.append(-signal.SIGKILL)
        return codes

    def adopt(self, group_id: str, task_dir: Path) -> SlurmJob:
        return SlurmJob(self.queue, group_id, Path(task_dir) / JOB_FILE)

    def waiting(self, group: ProcessGroup) -> bool:
        return _job(group).waiting

    def explain(self, group: ProcessGroup, outcome: Outcome) -> Outcome:
        """A job that Slurm ended (time or memory limit, cancelled, preempted, a node lost):
        that, rather than the bare exit code; a job whose task a signal killed: the signal
        (``srun`` exits 128 + the signal's number, as its manual says)."""
        if outcome.status == "ok":
            return outcome
        job = _job(group)
        state = job.state()
        status = STATUS_OF_STATE.get(state.state)
        if status is None:
            killed = _srun_signal(outcome.returncode) if state.state == "FAILED" else None
            if killed is None:
                return outcome
            what = f"a task of job {job.job_id} was killed by {killed} (srun's exit code)"
            return replace(outcome, detail=f"{what}; {outcome.detail}")
        what = {
            "timeout": f"Slurm ended job {job.job_id} at its time limit "
            f"(launch.slurm.time {self.config.time})",
            "out_of_memory": f"Slurm ended job {job.job_id} for exceeding its memory "
            f"(launch.slurm.mem {self.config.mem})",
        }.get(status, f"job {job.job_id} ended {state.state}")
        return replace(outcome, status=status, detail=f"{what}; {outcome.detail}")

    def take_over(self, task_dir: Path) -> str | None:
        """Adopt the job a crashed controller left for ``task_dir`` while it is queued or
        running, or once it has ended with an ok result (nothing is run twice); otherwise
        make sure it has ended, so that the retry never runs beside it."""
        record = read_job(task_dir)
        if record is None:
            return None
        job = SlurmJob(self.queue, str(record["job_id"]), Path(task_dir) / JOB_FILE)
        state = job.state()
        if not state.ended or ResultMessage.peek(Path(task_dir) / RESULT_FILE):
            return job.job_id
        return None

    def end_orphan_worker(self, folder: Path) -> None:
        """A long-lived worker job of a crashed controller is cancelled (its task is run
        again): it would take tasks from an inbox nobody writes any more."""
        record = read_job(folder)
        if record is not None:
            job = SlurmJob(self.queue, str(record["job_id"]), Path(folder) / JOB_FILE)
            if job.poll() is None:
                job.cancel()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.wait(JOB_CANCEL_WAIT_S)


def _srun_signal(returncode: int | None) -> str | None:
    """The signal's name when ``returncode`` is ``srun``'s for a task a signal ended (128 + its
    number), else None."""
    if returncode is None or not 128 < returncode < 128 + signal.NSIG:
        return None
    try:
        return signal.Signals(returncode - 128).name
    except ValueError:
        return None


def _job(group: ProcessGroup) -> SlurmJob:
    """``group`` as the Slurm job it is on this backend."""
    if not isinstance(group, SlurmJob):
        raise TypeError(f"the Slurm backend was given {group!r}, which is not a Slurm job")
    return group


def live_jobs(campaign_dir: Path) -> list[str]:
    """Ids of the jobs the campaign's records name (tasks and worker slots)."""
    folders = [*Path(campaign_dir).glob("tasks/*"), *Path(campaign_dir).glob("workers/slot*")]
    return sorted({str(r["job_id"]) for f in folders if (r := read_job(f)) is not None}, key=int)


def cancel_campaign_jobs(campaign_dir: Path) -> list[str]:
    """Cancel every job of the campaign that has not ended; the ids cancelled."""
    queue = SlurmQueue(poll_s=0.0)
    ids = [j for j in live_jobs(campaign_dir) if not queue.state(j).ended]
    queue.cancel(ids)
    return ids
