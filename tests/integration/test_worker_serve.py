"""A long-lived worker (``pbt.worker --serve``) with the real member code: each task's checkpoint
is written in the background once the task is released, and a failed background write is
reported as the fault it is and takes the worker down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pbt.algorithms.runtime.checkpoint import load_checkpoint
from pbt.launch.local import TaskSpec, member_command
from pbt.launch.persistent import PersistentLauncher
from pbt.protocol.files import RELEASED, write_json_atomic
from pbt.protocol.messages import TASK_FILE, TaskMessage
from pbt.protocol.progress import read_progress

pytestmark = pytest.mark.integration  # each test runs a real long-lived worker under torchrun

MANIFEST = {
    "model": {"name": "builtin:tiny"},
    "algorithm": {"group_size": 4, "prompts_per_step": 2},
    "rollout": {"max_output_tokens": 8},
    "task": {"name": "builtin:letters", "eval_size": 4},
    "training": {"device": "cpu", "steps": 4, "seed": 0},
}


def _tasks(
    campaign: Path, members: list[tuple[str, str | None]], manifest: dict = MANIFEST
) -> list[TaskSpec]:
    tasks = []
    for member, parent in members:
        task_dir = campaign / "tasks" / member
        task_dir.mkdir(parents=True)
        TaskMessage(
            campaign_dir=str(campaign),
            manifest=manifest,
            manifest_base_dir=str(campaign),
            member_id=member,
            generation=1 if parent else 0,
            parent_id=parent,
            parent_checkpoint=f"checkpoints/{parent}" if parent else None,
            parent_digest=None,
            hyperparameters={"lr": 1e-3},
            mutation="lr" if parent else None,
            steps=1,
            checkpoint=f"checkpoints/{member}",
        ).write(task_dir / TASK_FILE)
        tasks.append(TaskSpec(member, task_dir, campaign / "logs" / f"{member}.log"))
    return tasks


def _launcher(campaign: Path, **env: str) -> PersistentLauncher:
    return PersistentLauncher(
        member_command(),
        campaign / "workers",
        slots=1,
        heartbeat_timeout_s=120.0,
        env={"OMP_NUM_THREADS": "1", **env},
    )


def test_served_tasks_are_released_then_write_their_checkpoints(tmp_path: Path):
    """Three tasks on one worker, the third loading the first's checkpoint: each is released
    before its result, and each result names the digest of the checkpoint on disk, whose
    timings account for the background write; each heartbeat ends with the task's progress."""
    campaign = tmp_path / "campaign"
    tasks = _tasks(campaign, [("a", None), ("b", None), ("c", "a")])
    launcher = _launcher(campaign)
    try:
        outcomes = launcher.run(tasks)
    finally:
        launcher.close()
    assert [o.status for o in outcomes] == ["ok", "ok", "ok"], [o.detail for o in outcomes]
    for task, outcome in zip(tasks, outcomes, strict=True):
        assert (task.task_dir / RELEASED).exists()
        checkpoint = load_checkpoint(campaign / "checkpoints" / task.task_id)
        assert outcome.result.digest == checkpoint["digest"]
        assert outcome.result.write_s > 0
        assert checkpoint["lineage"]["member"] == task.task_id
        progress = read_progress(task.task_dir / "heartbeat")
        assert (progress.phase, progress.step, progress.steps) == ("saving", 1, 1)
        assert progress.reward is not None and progress.tokens_per_s > 0
    assert outcomes[2].result.steps == 2  # c went on from a's checkpoint
    served = sorted((campaign / "workers" / "slot0" / "inbox").glob("*.json"))
    assert len(served) == 3  # one worker served all three


@pytest.mark.parametrize(("cache_gib", "parent_from"), [(None, "memory"), (0.0, "disk")])
def test_the_worker_keeps_states_within_the_manifests_cache(
    tmp_path: Path, cache_gib: float | None, parent_from: str
):
    """A child of a member this worker trained loads its parent from the worker's memory,
    within ``launch.state_cache_gib`` of the manifest the tasks carry (default 8 GiB); with 0
    nothing is kept and the parent comes from disk (the worker reads no variable of its own)."""
    manifest = MANIFEST if cache_gib is None else {**MANIFEST, "launch": {"state_cache_gib": 0.0}}
    campaign = tmp_path / "campaign"
    launcher = _launcher(campaign)
    try:
        (first,) = launcher.run(_tasks(campaign, [("a", None)], manifest))
        (child,) = _tasks(campaign, [("c", "a")], manifest)
        task = child.task_dir / TASK_FILE
        dataclasses.replace(TaskMessage.read(task), parent_digest=first.result.digest).write(task)
        (second,) = launcher.run([child])
    finally:
        launcher.close()
    assert [first.status, second.status] == ["ok", "ok"], [first.detail, second.detail]
    assert second.result.parent_from == parent_from


def test_a_background_write_that_finds_the_disk_full_fails_its_task(tmp_path: Path):
    """The first checkpoint write finds the disk full: that task is recorded as ``disk_full``
    with the write's message, nothing partial is left, the worker ends, the task that was
    training on it fails with it, and a fresh worker serves the next task."""
    campaign = tmp_path / "campaign"
    tasks = _tasks(campaign, [("a", None), ("b", None)])
    launcher = _launcher(campaign, PBT_FAULT_AT="disk_full:1")
    try:
        first = launcher.run(tasks)
        launcher.env.pop("PBT_FAULT_AT")
        (retry,) = launcher.run(_tasks(campaign, [("b-retry", None)]))
    finally:
        launcher.close()
    assert first[0].status == "disk_full", first[0].detail
    assert "No space left on device" in first[0].detail
    assert first[1].status != "ok"
    assert retry.status == "ok", retry.detail
    on_disk = sorted(p.name for p in (campaign / "checkpoints").iterdir())
    assert on_disk == ["b-retry"]  # no partial or temporary folder of "a"


def test_the_parent_of_the_task_handed_ahead_is_prefetched_while_one_trains(tmp_path: Path):
    """``ParentAhead`` copies the parent state of the next inbox entry, when this worker holds
    it, while the current task trains; the next task takes that copy (the same values, its own
    storage) only for exactly that checkpoint and digest."""
    import torch

    from pbt.worker.cache import STATES, ParentAhead

    folder = tmp_path / "slot0"
    (folder / "inbox").mkdir(parents=True)
    state = {"trainable": {"w": torch.arange(6.0)}, "rng": [{"torch": torch.zeros(4)}]}
    STATES.put("checkpoints/g000-m01", "d1", state, 64)
    ahead = ParentAhead(folder)
    ahead.number = 1
    ahead.look(torch.device("cpu"))  # nothing handed ahead yet
    assert ahead.take("checkpoints/g000-m01", "d1") is None
    tasks = _tasks(tmp_path, [("g001-m00", None), ("g001-m01", "g000-m01")])
    for number, task in enumerate(tasks):
        write_json_atomic(
            folder / "inbox" / f"{number:06d}.json", {"task": str(task.task_dir / "task.json")}
        )
    task = tasks[1].task_dir / TASK_FILE
    dataclasses.replace(TaskMessage.read(task), parent_digest="d1").write(task)
    ahead.look(torch.device("cpu"))
    taken = ahead.take("checkpoints/g000-m01", "d1")
    assert torch.equal(taken["trainable"]["w"], state["trainable"]["w"])
    assert taken["trainable"]["w"].data_ptr() != state["trainable"]["w"].data_ptr()
    assert ahead.take("checkpoints/g000-m01", "d1") is None  # taken once
    ahead.look(torch.device("cpu"))
    assert ahead.take("checkpoints/g000-m01", "other digest") is None
    ahead.number = 0  # an entry whose task has no parent: nothing to copy
    ahead.look(torch.device("cpu"))
    assert ahead._copies is None


def test_the_latest_states_are_also_held_on_the_device_within_their_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``StateCache`` keeps a snapshot's device copy (views of its packed buffers) for the most
    recent states within the device budget, and serves it in place of the host copy; an older
    state loses its device copy first and is served from the host. A device-held parent is
    copied in a device copy a buffer, each view in its place, the held buffers untouched,
    and prefetched like any other. (The meta device stands in for a GPU: layouts and bytes, no values.)"""
    import torch

    from pbt.distributed.state import fresh_device_copies
    from pbt.worker.cache import ParentAhead, StateCache

    def state(device: str) -> dict:
        packed = torch.empty(30, device=device)  # one packed buffer of 120 bytes
        return {
            "trainable": {"a": packed[:10].view(2, 5), "b": packed[10:30]},
            "rng": [{"torch": torch.zeros(4, dtype=torch.uint8)}],
        }

    cache = StateCache(max_bytes=10_000, max_device_bytes=250)  # two device states
    for n in range(3):
        cache.put(f"checkpoints/m{n}", f"d{n}", state("cpu"), 120, on_device=state("meta"))
    assert cache.get("checkpoints/m0", "d0")["trainable"]["a"].device.type == "cpu"
    for n in (1, 2):
        held = cache.get(f"checkpoints/m{n}", f"d{n}")
        assert held["trainable"]["a"].device.type == "meta" and held["digest"] == f"d{n}"
    assert cache.get("checkpoints/m2", "another digest") is None
    cache.get("checkpoints/m1", "d1")  # used again: m2 is now the least recently used
    cache.put("checkpoints/m3", "d3", state("cpu"), 120, on_device=state("meta"))
    assert cache.get("checkpoints/m2", "d2")["trainable"]["a"].device.type == "cpu"
    assert cache.get("checkpoints/m1", "d1")["trainable"]["a"].device.type == "meta"
    too_big = {"w": torch.empty(100, device="meta")}  # 400 bytes, over the budget alone
    cache.put("checkpoints/big", "d", state("cpu"), 120, on_device=too_big)
    assert "w" not in cache.get("checkpoints/big", "d")  # held on the host only
    assert cache.get("checkpoints/m1", "d1")["trainable"]["a"].device.type == "meta"

    held = cache.get("checkpoints/m1", "d1")
    copied = fresh_device_copies(held)
    a, b = copied["trainable"]["a"], copied["trainable"]["b"]
    assert a.untyped_storage()._cdata == b.untyped_storage()._cdata  # one copy of the buffer
    assert a.untyped_storage()._cdata != held["trainable"]["a"].untyped_storage()._cdata
    assert (a.shape, a.storage_offset(), b.storage_offset()) == ((2, 5), 0, 10)
    assert copied["rng"][0]["torch"] is held["rng"][0]["torch"]  # host tensors pass through

    folder = tmp_path / "slot0"
    (folder / "inbox").mkdir(parents=True)
    tasks = _tasks(tmp_path, [("g001-m00", "m1")])
    task = tasks[0].task_dir / TASK_FILE
    message = TaskMessage.read(task)
    dataclasses.replace(message, parent_checkpoint="checkpoints/m1", parent_digest="d1").write(task)
    write_json_atomic(folder / "inbox" / "000000.json", {"task": str(task)})
    monkeypatch.setattr("pbt.worker.cache.STATES", cache)
    ahead = ParentAhead(folder)
    ahead.look(torch.device("cpu"))  # a device-held parent is copied ahead as well
    taken = ahead.take("checkpoints/m1", "d1")
    assert taken["trainable"]["a"].shape == (2, 5)
    assert taken["trainable"]["a"] is not held["trainable"]["a"]
