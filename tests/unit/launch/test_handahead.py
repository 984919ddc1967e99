"""The hand-ahead on its own: which tasks of the next call it hands to which slot, and which it
adopts or discards, with real task files and real (sleeping) processes standing for workers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pbt.launch.attempt import Outcome, Running, TaskSpec
from pbt.launch.handahead import HandAhead
from pbt.protocol.files import RELEASED
from pbt.protocol.messages import RESULT_FILE, TASK_FILE, ResultMessage, TaskMessage


def _message(name: str, parent: str | None = None, digest: str | None = None) -> TaskMessage:
    return TaskMessage(
        campaign_dir="/c",
        manifest={},
        manifest_base_dir="/c",
        member_id=name,
        generation=1 if parent else 0,
        parent_id=parent,
        parent_checkpoint=f"checkpoints/{parent}" if parent else None,
        parent_digest=digest,
        hyperparameters={"lr": 1e-3},
        mutation=None,
        steps=2,
        checkpoint=f"checkpoints/{name}",
    )


def _result(name: str, digest: str | None) -> ResultMessage:
    return ResultMessage(
        status="ok",
        member_id=name,
        fitness=0.5,
        steps=2,
        checkpoint=f"checkpoints/{name}",
        digest=digest,
        metrics={},
        history=[],
    )


@pytest.fixture
def workers():
    """Start a sleeping process per call (a worker's stand-in); all ended afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _spec(root: Path, message: TaskMessage) -> TaskSpec:
    folder = root / message.member_id
    folder.mkdir(parents=True, exist_ok=True)
    message.write(folder / TASK_FILE)
    return TaskSpec(message.member_id, folder, root / f"{message.member_id}.log")


def _running(task: TaskSpec, slot: int, proc, released: bool = True) -> Running:
    item = Running(-1, task, slot, 0, proc, time.monotonic(), time.time())
    item.released = released
    return item


def test_results_wait_for_every_release_and_read_the_released_ones(tmp_path: Path, workers):
    writing = _running(_spec(tmp_path, _message("a1")), 1, workers())
    outcomes = {0: Outcome("a0", "ok", 0, _result("a0", "d0"), "", 1.0)}
    assert HandAhead.results([writing], outcomes) is None  # a1's result is not there yet
    _result("a1", None).write(writing.task.task_dir / RELEASED)
    results = HandAhead.results([writing], outcomes)
    assert results == {"a0": _result("a0", "d0"), "a1": _result("a1", None)}
    writing.released = False
    assert HandAhead.results([writing], outcomes) is None
    failed = {0: Outcome("a0", "failed", 1, None, "exit code 1", 1.0)}
    writing.released = True
    assert HandAhead.results([writing], failed) is None  # nothing is guessed after a failure


def test_a_child_of_a_parent_being_written_goes_only_to_the_slot_writing_it(tmp_path, workers):
    writers = [_running(_spec(tmp_path, _message(f"a{i}")), i, workers()) for i in range(3)]
    results = {f"a{i}": _result(f"a{i}", None) for i in range(3)}
    results["a0"] = _result("a0", "d0")
    writers[0].ended = True  # a0 is on disk
    tasks = [
        _spec(tmp_path, _message("b0", "a2")),  # parent written by slot 2
        _spec(tmp_path, _message("b1", "a0", "d0")),  # parent on disk: any idle slot
        _spec(tmp_path, _message("b2", "zz")),  # parent written by no one: not handed
    ]
    started: list[tuple[str, int]] = []

    def start(task: TaskSpec, slot: int) -> Running | None:
        if slot == 0:  # that slot's worker cannot queue it
            return None
        started.append((task.task_id, slot))
        return _running(task, slot, workers(), released=False)

    ahead = HandAhead()
    ahead.hand(tasks, [0, 1, 2], writers, results, start)
    assert started == [("b0", 2), ("b1", 1)]
    assert ahead.handed() == {"b0", "b1"}


def test_a_worker_that_runs_tasks_together_is_handed_that_many(tmp_path, workers):
    """With ``per_slot`` (a worker's ``launch.members_per_batch``), each idle slot is handed up
    to that many tasks, in order, so its worker starts them as one batch; a child of a parent
    being written still goes only to the writer's slot, while it has room."""
    writers = [_running(_spec(tmp_path, _message(f"a{i}")), i, workers()) for i in range(2)]
    results = {f"a{i}": _result(f"a{i}", None) for i in range(2)}
    tasks = [_spec(tmp_path, _message(f"b{i}", f"a{i % 2}")) for i in range(6)]
    started: list[tuple[str, int]] = []

    def start(task: TaskSpec, slot: int) -> Running | None:
        started.append((task.task_id, slot))
        return _running(task, slot, workers(), released=False)

    ahead = HandAhead()
    ahead.hand(tasks, [0, 1], writers, results, start, per_slot=2)
    assert started == [("b0", 0), ("b1", 1), ("b2", 0), ("b3", 1)]  # b4, b5: no room left
    on_disk = [_spec(tmp_path, _message(f"c{i}", "a0", "d0")) for i in range(3)]
    started.clear()
    HandAhead().hand(on_disk, [0, 1], writers, results, start, per_slot=2)
    assert started == [("c0", 0), ("c1", 0), ("c2", 1)]


def test_adopted_are_the_unchanged_tasks_on_live_workers(tmp_path: Path, workers):
    writer = _running(_spec(tmp_path, _message("a1")), 0, workers())
    _result("a1", "d1").write(writer.task.task_dir / RESULT_FILE)  # the write has ended
    tasks = {
        "b0": _spec(tmp_path, _message("b0", "a1")),  # handed with a null digest
        "b1": _spec(tmp_path, _message("b1", "a0", "d0")),
        "b2": _spec(tmp_path, _message("b2", "a0", "d0")),
        "b3": _spec(tmp_path, _message("b3", "a0", "d0")),
    }
    ahead = HandAhead()
    handed = {}

    def start(task: TaskSpec, slot: int) -> Running:
        handed[task.task_id] = _running(task, slot, workers(), released=False)
        return handed[task.task_id]

    results = {"a1": _result("a1", None)}
    ahead.hand(list(tasks.values()), [0, 1, 2, 3], [writer], results, start)
    assert ahead.handed() == set(tasks)
    # the committed tasks: b0 with its parent's digest as written, b1 as handed, b2 changed,
    # b3's worker gone
    _message("b0", "a1", "d1").write(tasks["b0"].task_dir / TASK_FILE)
    changed = dataclasses.replace(_message("b2", "a0", "d0"), hyperparameters={"lr": 2e-3})
    changed.write(tasks["b2"].task_dir / TASK_FILE)
    handed["b3"].proc.kill()
    handed["b3"].proc.wait()
    discarded: list[str] = []
    kept = ahead.adopt(list(tasks.values()), lambda item: discarded.append(item.task.task_id))
    assert [item.task.task_id for item in kept] == ["b0", "b1"] == ahead.kept
    assert [item.index for item in kept] == [0, 1]
    assert sorted(discarded) == ["b2", "b3"]
    assert ahead.handed() == set()


def test_a_null_digest_is_adopted_only_for_the_digest_its_parents_write_gave(tmp_path, workers):
    writer = _running(_spec(tmp_path, _message("a1")), 0, workers())
    _result("a1", "d1").write(writer.task.task_dir / RESULT_FILE)
    task = _spec(tmp_path, _message("b0", "a1"))
    ahead = HandAhead()
    ahead.hand(
        [task],
        [0],
        [writer],
        {"a1": _result("a1", None)},
        lambda t, s: _running(t, s, workers(), released=False),
    )
    _message("b0", "a1", "another").write(task.task_dir / TASK_FILE)
    discarded: list[str] = []
    assert ahead.adopt([task], lambda item: discarded.append(item.task.task_id)) == []
    assert discarded == ["b0"] and ahead.kept == []
