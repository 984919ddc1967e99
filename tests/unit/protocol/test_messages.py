"""The task and result messages: round trips, the version check, unknown and missing keys,
and a wrong type refused for every field, each with one line that names it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pbt.protocol.messages import (
    RESULT_FILE,
    TASK_FILE,
    VERSION,
    Fault,
    MessageError,
    ResultMessage,
    TaskMessage,
)

TASK = TaskMessage(
    campaign_dir="/runs/c",
    manifest={"training": {"seed": 3}, "model": {"name": "builtin:tiny"}},
    manifest_base_dir="/runs",
    member_id="g001-m02",
    generation=1,
    parent_id="g000-m01",
    parent_checkpoint="checkpoints/g000-m01",
    parent_digest="abc123",
    hyperparameters={"lr": 3e-4, "group_size": 6},
    mutation="lr x1.2",
    steps=4,
    checkpoint="checkpoints/g001-m02",
)

RESULT = ResultMessage(
    status="ok",
    member_id="g001-m02",
    fitness=0.625,
    steps=8,
    checkpoint="checkpoints/g001-m02",
    digest="def456",
    metrics={"reward_mean": 0.5, "zero_signal_fraction": 0.0},
    history=[{"step": 7, "reward_mean": 0.25}, {"step": 8, "reward_mean": 0.5}],
    fault=Fault(kind="collapsed", detail="no signal for 3 steps"),
    seconds=1.5,
    productive_seconds=1.25,
    write_s=0.125,
    timings={"setup": 0.5, "train": 1.0},
    world_size=1,
    device="cpu",
    parent_from="memory",
    parent_prefetched=True,
    parent_in_flight=False,
    parent_on_device=False,
    peak_memory_gib=None,
)

# a value of the wrong type for every field of each message
WRONG = {
    "campaign_dir": 3,
    "manifest": ["training"],
    "manifest_base_dir": None,
    "member_id": 7,
    "generation": 1.5,
    "parent_id": 0,
    "parent_checkpoint": ["checkpoints/x"],
    "parent_digest": 12,
    "hyperparameters": {"lr": "fast"},
    "mutation": {"lr": 1.2},
    "steps": "4",
    "checkpoint": None,
    "version": "1",
    "status": "error",
    "fitness": "0.5",
    "digest": 5,
    "metrics": {"reward_mean": None},
    "history": [{"step": "one"}],
    "fault": {"kind": "collapsed"},
    "seconds": True,
    "productive_seconds": "1",
    "write_s": [],
    "timings": {"train": "1 s"},
    "world_size": 1.0,
    "device": 0,
    "parent_from": "cache",
    "parent_prefetched": 1,
    "parent_in_flight": "no",
    "parent_on_device": 0.0,
    "peak_memory_gib": "2 GiB",
}


@pytest.mark.parametrize("message", [TASK, RESULT], ids=["task", "result"])
def test_a_message_survives_json_and_a_file(message, tmp_path: Path) -> None:
    kind = type(message)
    data = json.loads(json.dumps(message.to_dict()))
    assert data["version"] == VERSION
    assert kind.from_dict(data) == message
    path = tmp_path / "message.json"
    message.write(path)
    assert kind.read(path) == message
    assert [p.name for p in tmp_path.iterdir()] == ["message.json"]  # no temporary file left


def test_a_result_without_the_workers_figures_takes_none_for_them() -> None:
    """The fake member writes only the contract's fields; the figures default to None."""
    data = {
        k: v
        for k, v in RESULT.to_dict().items()
        if k in ("status", "member_id", "fitness", "steps", "checkpoint", "digest")
        or k in ("metrics", "history")
    }
    result = ResultMessage.from_dict(data)
    assert result.fault is None and result.seconds is None and result.parent_from is None
    assert result.history == RESULT.history


@pytest.mark.parametrize("message", [TASK, RESULT], ids=["task", "result"])
def test_every_field_is_typed(message) -> None:
    fields = [f.name for f in dataclasses.fields(message)]
    assert set(fields) <= set(WRONG), "a field without a wrong value here"
    for name in fields:
        data = message.to_dict() | {name: WRONG[name]}
        if name == "version":
            continue  # a version other than this one is refused as such (below)
        with pytest.raises(MessageError) as err:
            type(message).from_dict(data, "m.json")
        assert str(err.value).startswith(f"m.json: not a {message.kind} this pbt reads: {name} (")
        assert "\n" not in str(err.value)


def test_an_int_is_a_number_but_a_bool_is_not() -> None:
    assert ResultMessage.from_dict(RESULT.to_dict() | {"fitness": 1}).fitness == 1
    with pytest.raises(MessageError, match=r"fitness \(True\) is not a number"):
        ResultMessage.from_dict(RESULT.to_dict() | {"fitness": True})


@pytest.mark.parametrize("version", [2, 0, "1", None, True])
def test_another_version_is_refused_in_one_line(version) -> None:
    with pytest.raises(MessageError) as err:
        TaskMessage.from_dict(TASK.to_dict() | {"version": version}, "tasks/x/task.json")
    assert str(err.value) == (
        f"tasks/x/task.json: task version {version!r} is not version {VERSION}, the one this "
        "pbt reads; run the campaign with the pbt version that wrote it"
    )


def test_a_file_from_before_the_version_field_reads_as_version_1() -> None:
    data = TASK.to_dict()
    del data["version"]
    assert TaskMessage.from_dict(data) == TASK


def test_unknown_and_missing_keys_are_refused_together() -> None:
    data = RESULT.to_dict() | {"fitnes": 0.5, "extra": 1}
    del data["steps"], data["checkpoint"]
    with pytest.raises(MessageError) as err:
        ResultMessage.from_dict(data, "result.json")
    message = str(err.value)
    for problem in ("unknown key 'fitnes'", "unknown key 'extra'", "missing key 'steps'"):
        assert problem in message
    assert "missing key 'checkpoint'" in message


def test_a_task_has_no_defaults_but_its_version() -> None:
    """A controller that forgets a field fails when it writes, not in a member."""
    required = [f.name for f in dataclasses.fields(TaskMessage) if f.name != "version"]
    for name in required:
        with pytest.raises(MessageError, match=f"missing key '{name}'"):
            TaskMessage.from_dict({k: v for k, v in TASK.to_dict().items() if k != name})


def test_not_an_object_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MessageError, match="a result is a JSON object, not list"):
        ResultMessage.from_dict([1, 2])
    path = tmp_path / RESULT_FILE
    path.write_text("[1, 2]")  # read_json takes only objects: not a message yet
    assert ResultMessage.read(path) is None and ResultMessage.peek(path) is None


def test_read_and_peek(tmp_path: Path) -> None:
    path = tmp_path / TASK_FILE
    assert TaskMessage.read(path) is None and TaskMessage.peek(path) is None  # not there
    path.write_text('{"campaign_dir": "/r')  # cut off mid-write (writes are atomic; a stray)
    assert TaskMessage.read(path) is None
    path.write_text(json.dumps(TASK.to_dict() | {"version": 9}))
    with pytest.raises(MessageError, match="task version 9"):
        TaskMessage.read(path)
    assert TaskMessage.peek(path) is None
    TASK.write(path)
    assert TaskMessage.peek(path) == TASK


def test_a_nested_fault_is_built_and_checked() -> None:
    result = ResultMessage.from_dict(RESULT.to_dict())
    assert isinstance(result.fault, Fault) and result.fault.kind == "collapsed"
    bad = RESULT.to_dict() | {"fault": {"kind": "collapsed", "detail": "x", "why": "y"}}
    with pytest.raises(MessageError, match="fault"):
        ResultMessage.from_dict(bad)


def test_messages_are_frozen_and_slotted() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        TASK.steps = 5  # type: ignore[misc]
    assert not hasattr(TASK, "__dict__") and not hasattr(RESULT, "__dict__")


def test_the_messages_import_no_torch() -> None:
    code = (
        "import sys, pbt.protocol.messages; print(any(m.startswith('torch') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
