"""The files through which dedicated rollout engines are seen: the placement a launcher hands
its members, and the status a trainer writes for each engine, read back by ``pbt status``."""

from __future__ import annotations

import json

from pbt.protocol.engines import (
    PLACEMENT_ENV,
    EnginePlacement,
    EngineStatus,
    read_statuses,
    status_path,
    write_status,
)


def _status(rank: int, **changes) -> EngineStatus:
    fields = dict(
        member_id="g000-m01", rank=rank, pid=4242, trainer_pid=4100, device="cuda:1 (GPU 5)",
        placement="dedicated", state="serving", version=7, heartbeat=1000.0, restarts=1,
        stale_dropped=16, written=1001.0,
    )  # fmt: skip
    return EngineStatus(**{**fields, **changes})


def test_statuses_round_trip_by_rank_and_damaged_files_are_left_out(tmp_path) -> None:
    write_status(tmp_path, _status(1))
    write_status(tmp_path, _status(0, pid=None, heartbeat=None, state="failed"))
    assert read_statuses(tmp_path) == [
        _status(0, pid=None, heartbeat=None, state="failed"), _status(1),
    ]  # fmt: skip
    status_path(tmp_path, 2).write_text('{"rank": 2, "pid": 1')  # torn
    status_path(tmp_path, 3).write_text(json.dumps({**_status(3).to_json(), "version": "7"}))
    assert [s.rank for s in read_statuses(tmp_path)] == [0, 1]
    assert read_statuses(tmp_path / "nowhere") == []


def test_a_status_is_one_line_of_pbt_status() -> None:
    assert _status(0).line(now=1012.4) == (
        "engine 0: pid 4242 on cuda:1 (GPU 5) (dedicated), serving, adapter v7, heartbeat "
        "12 s ago, restarts 1, stale_dropped 16"
    )
    gone = _status(0, pid=None, heartbeat=None, state="failed").line(now=0.0)
    assert "pid - on" in gone and "failed" in gone and "heartbeat none" in gone


def test_the_placement_crosses_in_one_variable() -> None:
    placement = EnginePlacement("shared", 2)
    assert EnginePlacement.from_env({PLACEMENT_ENV: placement.to_env()}) == placement
    for bad in ("", "dedicated", "gpu:1", "cpu:x"):
        assert EnginePlacement.from_env({PLACEMENT_ENV: bad}) is None
    assert EnginePlacement.from_env({}) is None
