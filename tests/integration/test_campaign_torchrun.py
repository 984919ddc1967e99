"""Campaigns with the real member entry point under torchrun on CPU: fitness improves, a member
killed mid-task is retried, and a controller killed mid-generation resumes to exactly the
decisions of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pbt.controller.store import CampaignStore
from pbt.protocol.files import read_json
from tests.support import TINY_CAMPAIGN

pytestmark = pytest.mark.integration

MANIFEST = TINY_CAMPAIGN

PBT = [sys.executable, "-m", "pbt.cli"]


SLOW_WRITES = {"PBT_DELAY_AT": "checkpoint_write:0.3"}
"""Checkpoint writes that outlast the controller's look at the results, as a 0.5B model's do
(the tiny model's take milliseconds): the next generation then starts behind them."""


def _decisions(directory: Path) -> list[tuple]:
    with CampaignStore(directory / "store.db") as store:
        return [
            (m.member_id, m.parent_id, m.hyperparameters, m.mutation, m.fitness_history, m.status)
            for m in store.members()
        ]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the campaign ended before the moment to interrupt it"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _kill_worker(task_json: str) -> None:
    """SIGKILL the member process whose command line names ``task_json``: torchrun's child,
    not torchrun itself (both name it; a member outlives its agent once it has connected)."""
    named = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if b"pbt.worker" in cmdline and any(task_json.encode() in part for part in cmdline):
            named[pid] = ppid
    members = [pid for pid, ppid in named.items() if ppid in named]
    assert members, f"no member process for {task_json} (found {sorted(named)})"
    os.kill(int(members[0]), signal.SIGKILL)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "campaign.yaml"
    path.write_text(yaml.safe_dump(MANIFEST))
    return path


@pytest.fixture(scope="module")
def reference(manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The campaign run straight through, every member in a process of its own, one member
    (g001-m02) killed mid-task and retried from its parent: its directory and its output."""
    directory = tmp_path_factory.mktemp("reference") / "campaign"
    proc = subprocess.Popen(
        [*PBT, "run", str(manifest), "--dir", str(directory)],
        stdout=subprocess.PIPE,
        text=True,
    )
    _wait_for(directory / "tasks" / "g001-m02" / "heartbeat", proc)
    _kill_worker("g001-m02/task.json")  # at once: a task of 4 steps is over in seconds
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    return directory, out


def test_fitness_improves_and_a_killed_member_is_retried(reference: tuple[Path, str]):
    directory, out = reference
    assert "stopped: 3 generations done" in out and "lineage of the best member" in out
    with CampaignStore(directory / "store.db") as store:
        members = store.members()
        faults = store.faults()
    assert [(f["member_id"], f["kind"]) for f in faults] == [("g001-m02", "failed")]
    assert next(m for m in members if m.member_id == "g001-m02").attempts == 2
    first = [m.fitness_history[-1] for m in members if m.generation == 0]
    last = [m.fitness_history[-1] for m in members if m.generation == 2]
    assert sum(last) / len(last) > sum(first) / len(first) + 0.05, (first, last)
    assert max(last) >= max(first)
    status = subprocess.run([*PBT, "status", str(directory)], capture_output=True, text=True)
    assert status.returncode == 0 and "g002-m00" in status.stdout and "faults (1)" in status.stdout
    # MLflow (the embedded store): real members' per-step metrics and the best adapter
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{directory.resolve()}/mlflow.db")
    experiment = client.get_experiment_by_name(f"campaign {directory.resolve()}")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    parent = runs[directory.name]
    history = client.get_metric_history(runs["g002-m00"].info.run_id, "kl")
    assert [m.step for m in history] == [9, 10, 11, 12]
    for key in ("reward_std", "clip_fraction", "zero_signal_fraction", "tokens_per_s", "lr"):
        assert key in runs["g002-m00"].data.metrics, key
    folder = "best_adapter/adapter"
    adapter = {a.path for a in client.list_artifacts(parent.info.run_id, folder)}
    assert (
        f"{folder}/adapter_model.safetensors" in adapter
        and f"{folder}/adapter_config.json" in adapter
    )


@pytest.fixture(scope="module")
def persistent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The manifest with ``launch.persistent_workers``: one worker group per slot."""
    path = tmp_path_factory.mktemp("p") / "persistent.yaml"
    launch = {**MANIFEST["launch"], "persistent_workers": True}
    path.write_text(yaml.safe_dump({**MANIFEST, "launch": launch}))
    return path


def _digests(directory: Path) -> dict[str, str | None]:
    with CampaignStore(directory / "store.db") as store:
        return {m.member_id: m.checkpoint_digest for m in store.members()}


def test_long_lived_workers_train_the_same_members(
    reference: tuple[Path, str], persistent: Path, tmp_path: Path
):
    """``launch.persistent_workers``: one worker group per slot serves every task of the
    campaign on a model loaded once, and every member comes out bit for bit as it does from a
    process of its own: the same decisions, fitness and checkpoint digests. With writes that
    outlast the controller's look at the results (two seconds each, longer than the two slots'
    last members end apart), the next generation's first members start behind them, a child
    of a parent still being written on the worker writing it, from that worker's memory."""
    reference = reference[0]
    directory = tmp_path / "campaign"
    proc = subprocess.run(
        [*PBT, "run", str(persistent), "--dir", str(directory)], capture_output=True, text=True,
        timeout=900, env={**os.environ, "PBT_DELAY_AT": "checkpoint_write:2.0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for generation in (0, 1):
        assert f"started while generation {generation}'s last checkpoints were written" in (
            proc.stdout
        ), proc.stdout[-3000:]
    results = [read_json(p) for p in (directory / "tasks").glob("g00[12]-*/result.json")]
    assert any(r["parent_in_flight"] for r in results), [r["parent_from"] for r in results]
    assert _decisions(directory) == _decisions(reference)
    assert _digests(directory) == _digests(reference)
    served = sorted((directory / "workers").glob("slot*/inbox/*.json"))
    assert len(served) == len(_decisions(reference))  # every task went to a live worker
    assert len({p.parent.parent for p in served}) == MANIFEST["launch"]["slots"]
    assert not any(_alive(p) for p in (directory / "workers").glob("slot*/pgid"))  # all ended
    # a parent trained by the same worker is loaded from its memory, not from disk
    froms = [
        read_json(p)["parent_from"] for p in (directory / "tasks").glob("g00[12]-*/result.json")
    ]
    assert "memory" in froms and set(froms) <= {"memory", "disk"}, froms


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The manifest on one long-lived worker: at each generation's end one member is still
    being written, so the next generation's first members start behind it."""
    path = tmp_path_factory.mktemp("one") / "one_slot.yaml"
    launch = {**MANIFEST["launch"], "slots": 1, "persistent_workers": True}
    path.write_text(yaml.safe_dump({**MANIFEST, "launch": launch}))
    return path


def test_members_trained_at_once_equal_members_trained_one_at_a_time(
    reference: tuple[Path, str], one_slot: Path, tmp_path: Path
):
    """Two members at a time (the reference: two slots, as ``members_per_gpu: 2`` runs them on
    one GPU) against one at a time on one long-lived worker: bit for bit the same members, at
    the same number of threads per member."""
    path = one_slot
    directory = tmp_path / "campaign"
    # the reference's two slots ran a thread each; one thread here too, or the float sums of
    # CPU matmuls are ordered differently (same decisions, other last bits)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **SLOW_WRITES}
    proc = subprocess.run([*PBT, "run", str(path), "--dir", str(directory)],
                          capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _decisions(directory) == _decisions(reference[0])
    assert _digests(directory) == _digests(reference[0])
    # each later generation's first members trained while the one before wrote its last
    # checkpoints (a guess of the next generation, kept because selection chose the same)
    for generation in (0, 1):
        assert f"started while generation {generation}'s last checkpoints were written" in (
            proc.stdout
        ), proc.stdout
    froms = [
        read_json(p)["parent_from"] for p in (directory / "tasks").glob("g00[12]-*/result.json")
    ]
    assert froms and set(froms) == {"memory"}, froms  # one worker trained every parent
    # a task handed ahead has its parent prefetched while the task before it trains
    prefetched = [
        read_json(p)["parent_prefetched"]
        for p in (directory / "tasks").glob("g00[12]-*/result.json")
    ]
    assert any(prefetched), prefetched


def _alive(pgid_file: Path) -> bool:
    try:
        os.killpg(int(pgid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def test_killed_controller_resumes_to_the_same_decisions(
    one_slot: Path, reference: tuple[Path, str], tmp_path: Path
):
    """A controller SIGKILLed with generation 1's results in, its last checkpoints being
    written and generation 2's first members already training behind them (its long-lived
    workers orphaned), then resumed, makes exactly the decisions of the uninterrupted run (whose
    members each ran in a process of their own: the two modes train the same members, as the
    test above shows)."""
    straight = reference[0]
    directory = tmp_path / "killed"
    proc = subprocess.Popen(
        [*PBT, "run", str(one_slot), "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PBT_CRASH_AT": "ahead:2", "OMP_NUM_THREADS": "1", **SLOW_WRITES},
    )
    # its members live on as orphans, which the resumed controller ends
    assert proc.wait(timeout=600) == -signal.SIGKILL, "no task was started ahead"
    with CampaignStore(directory / "store.db") as store:
        assert store.last_committed_generation() == 0
        assert {m.status for m in store.members(1)} == {"running"}
    assert any((directory / "tasks").glob("g002-*/task.json"))
    resumed = subprocess.run(
        [*PBT, "resume", str(directory)], capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _decisions(directory) == _decisions(straight)
    # a library-mode population of the same manifest makes exactly the campaign's decisions
    from pbt.library.create import create_population
    from pbt.library.loop import train_population

    pop = create_population(config={**MANIFEST, "training": {**MANIFEST["training"]}})
    evo, generations = MANIFEST["population"]["evo_steps"], MANIFEST["budget"]["generations"]
    history = {}
    real_next = type(pop).next_generation

    def record(population, selected):
        for agent in population:
            history[agent.member_id] = (agent.parent_id, agent.mutation, list(agent.fitness))
        return real_next(population, selected)

    type(pop).next_generation = record
    try:
        train_population(
            pop, steps=evo * generations, evo_steps=evo, output_dir=tmp_path / "lib",
            tracking=False, progress=False,
        )  # fmt: skip
    finally:
        type(pop).next_generation = real_next
    for agent in pop:
        history[agent.member_id] = (agent.parent_id, agent.mutation, list(agent.fitness))
    with CampaignStore(straight / "store.db") as store:
        campaign = {
            m.member_id: (m.parent_id, m.mutation, m.fitness_history) for m in store.members()
        }
    for member_id, (parent, mutation, fitness) in campaign.items():
        assert history[member_id][:2] == (parent, mutation), member_id
        assert history[member_id][2] == pytest.approx(fitness, abs=1e-9), member_id
    on_disk = {p.name for p in (directory / "checkpoints").iterdir()}
    with CampaignStore(directory / "store.db") as store:
        needed = {Path(m.checkpoint).name for m in store.members(2)}
    assert needed <= on_disk and len(on_disk) <= 2 * 4 + 1
