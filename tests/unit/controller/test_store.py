"""The campaign store on real SQLite files: round trips, atomic generations, crash safety."""

from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from pbt.config.errors import PbtError
from pbt.controller.store import STORE_FILENAME, CampaignStore
from pbt.protocol.records import MemberRecord


def _member(generation: int, index: int, parent: MemberRecord | None = None) -> MemberRecord:
    return MemberRecord(
        member_id=f"g{generation:03d}-m{index:02d}",
        generation=generation,
        parent_id=parent.member_id if parent else None,
        parent_checkpoint=parent.checkpoint if parent else None,
        hyperparameters={"lr": 1e-4 * (index + 1), "group_size": 4},
        mutation="none" if parent else None,
        fitness_history=list(parent.fitness_history) if parent else [],
    )


def _finish(record: MemberRecord, fitness: float) -> MemberRecord:
    record.checkpoint = f"ckpt/{record.member_id}"
    record.checkpoint_digest = f"sha256:{record.member_id}"
    record.fitness_history.append(fitness)
    record.status = "done"
    record.attempts = 1
    record.steps += 10
    return record


def _run_generations(store: CampaignStore, fitness: dict[int, list[float]]) -> list[MemberRecord]:
    """Commit one generation per ``fitness`` entry; member i clones member i of the last one."""
    current = [_member(0, i) for i in range(len(fitness[0]))]
    store.add_members(current)
    for generation, scores in sorted(fitness.items()):
        finished = [_finish(m, score) for m, score in zip(current, scores, strict=True)]
        current = [_member(generation + 1, i, parent) for i, parent in enumerate(finished)]
        events = [
            {"kind": "clone", "member_id": m.member_id, "parent_id": m.parent_id} for m in current
        ]
        state = {"rng": [generation, 12345678901234567890]}
        best = max(finished, key=lambda m: m.fitness())
        store.commit_generation(
            generation, finished, current, events, state, (best.member_id, best.fitness())
        )
    return current


def test_member_record_round_trips_every_field(tmp_path: Path):
    record = MemberRecord(
        member_id="g002-m01",
        generation=2,
        parent_id=None,
        parent_checkpoint="ckpt/g001-m03",
        hyperparameters={"lr": 3.5e-5, "group_size": 8, "beta": 0.0},
        mutation="lr x1.2",
        checkpoint="ckpt/g002-m01",
        checkpoint_digest="sha256:abc",
        fitness_history=[0.25, -math.inf, 0.5],
        status="running",
        attempts=2,
        steps=300,
    )
    with CampaignStore(tmp_path / "c.db") as store:
        store.add_members([record])
        assert store.member("g002-m01") == record
        assert store.members(2) == [record]
        assert isinstance(store.member("g002-m01").hyperparameters["group_size"], int)
        record.status, record.attempts = "done", 3
        record.fitness_history.append(0.75)
        store.update_member(record)
    with CampaignStore(tmp_path / "c.db") as reopened:
        assert reopened.member("g002-m01") == record
        with pytest.raises(PbtError, match="no member 'nobody'"):
            reopened.member("nobody")
        with pytest.raises(PbtError, match="no member 'g009-m00'"):
            reopened.update_member(_member(9, 0))


def test_directory_path_opens_the_store_file_inside(tmp_path: Path):
    with CampaignStore(tmp_path) as store:
        store.save_config({"seed": 1})
    assert (tmp_path / STORE_FILENAME).is_file()


def test_config_is_written_once(tmp_path: Path):
    with CampaignStore(tmp_path / "c.db") as store:
        assert store.load_config() is None
        store.save_config({"pbt": {"population_size": 4}, "seed": 7})
        store.save_config({"seed": 7, "pbt": {"population_size": 4}})  # equal: a no-op
        with pytest.raises(PbtError, match="already holds a different config"):
            store.save_config({"pbt": {"population_size": 8}, "seed": 7})
    with CampaignStore(tmp_path / "c.db") as reopened:
        assert reopened.load_config() == {"pbt": {"population_size": 4}, "seed": 7}


def test_committed_generations_survive_reopening(tmp_path: Path):
    with CampaignStore(tmp_path / "c.db") as store:
        next_members = _run_generations(store, {0: [1.0, 2.0], 1: [3.0, 0.5]})
    with CampaignStore(tmp_path / "c.db") as store:
        assert store.last_committed_generation() == 1
        assert store.controller_state(1) == {"rng": [1, 12345678901234567890]}
        assert store.members(2) == next_members
        assert [m.status for m in store.members(1)] == ["done", "done"]
        assert store.best() == ("g001-m00", 3.0)
        with pytest.raises(PbtError, match="no committed generation 5; the last committed is 1"):
            store.controller_state(5)


def _snapshot(path: Path) -> dict[str, list[tuple]]:
    with closing(sqlite3.connect(path)) as db:
        tables = ["members", "lineage", "generations", "checkpoints", "faults"]
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in tables}


@pytest.mark.parametrize(
    "failure",
    ["duplicate next member", "unserialisable event", "unserialisable state", "unknown member"],
)
def test_failed_commit_lands_nothing(tmp_path: Path, failure: str):
    store = CampaignStore(tmp_path / "c.db")
    current = _run_generations(store, {0: [1.0, 2.0]})
    before = _snapshot(tmp_path / "c.db")
    finished = [_finish(m, 9.0) for m in current]
    next_members = [_member(2, i, p) for i, p in enumerate(finished)]
    events = [{"kind": "elite", "member_id": finished[1].member_id, "detail": {"rank": 1}}]
    state: dict = {"rng": [1, 2]}
    if failure == "duplicate next member":
        next_members.append(_member(2, 0))
        error: type[Exception] = sqlite3.IntegrityError
    elif failure == "unserialisable event":
        events.append({"kind": "mutate", "member_id": "g002-m00", "detail": object()})
        error = TypeError
    elif failure == "unserialisable state":
        state["rng"] = object()
        error = TypeError
    else:  # a foreign key checked only at COMMIT: the failed COMMIT must roll back too
        events.append({"kind": "replace", "member_id": "g002-m77"})
        error = sqlite3.IntegrityError
    with pytest.raises(error):
        store.commit_generation(1, finished, next_members, events, state, ("g001-m01", 9.0))
    store.close()
    assert _snapshot(tmp_path / "c.db") == before
    with CampaignStore(tmp_path / "c.db") as reopened:
        assert reopened.last_committed_generation() == 0
        assert reopened.members(2) == []
        assert {m.status for m in reopened.members(1)} == {"pending"}


def test_generations_commit_in_order_only(tmp_path: Path):
    with CampaignStore(tmp_path / "c.db") as store:
        current = _run_generations(store, {0: [1.0]})
        with pytest.raises(ValueError, match="not after the last committed"):
            store.commit_generation(0, [], [], [], {}, None)
        with pytest.raises(ValueError, match="member g001-m00 is not of generation 2"):
            store.commit_generation(2, current, [], [], {}, None)
        with pytest.raises(ValueError, match="member g001-m00 is not of generation 3"):
            store.commit_generation(2, [], current, [], {}, None)
        assert store.last_committed_generation() == 0


_KILLED_WRITER = """
import os, sys, time
from pbt.protocol.records import MemberRecord
from pbt.controller.store import CampaignStore

class SlowList(list):
    # Hands rows to the store one by one and stalls halfway, inside the open transaction.
    def __iter__(self):
        for index, item in enumerate(super().__iter__()):
            if index == len(self) // 2:
                print("inside", flush=True)
                time.sleep(60)
            yield item

def member(generation, index, **fields):
    hps = {f"hp{k}": k * 0.5 for k in range(40)}
    return MemberRecord(member_id=f"g{generation:03d}-m{index:05d}", generation=generation,
                        hyperparameters=hps, **fields)

store = CampaignStore(sys.argv[1])
first = [member(0, i) for i in range(4)]
store.add_members(first)
done = [member(0, i, status="done", fitness_history=[float(i)]) for i in range(4)]
store.commit_generation(0, done, [member(1, i) for i in range(4)], [], {"rng": 0}, None)
print(os.path.getsize(sys.argv[1] + "-wal"), flush=True)
many = SlowList(member(2, i) for i in range(12000))
store.commit_generation(1, [member(1, i, status="done") for i in range(4)], many, [],
                        {"rng": 1}, None)
"""


def test_sigkill_mid_commit_leaves_only_complete_generations(tmp_path: Path):
    path = tmp_path / "c.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        committed_wal = int(writer.stdout.readline())
        assert writer.stdout.readline().strip() == "inside"
        # The open transaction has already spilled uncommitted pages into the WAL.
        assert os.path.getsize(f"{path}-wal") > committed_wal
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with CampaignStore(path) as store:
        assert store.last_committed_generation() == 0
        assert store.controller_state(0) == {"rng": 0}
        assert len(store.members(1)) == 4
        assert {m.status for m in store.members(1)} == {"pending"}
        assert store.members(2) == []


_LOOPING_WRITER = """
import sys
from pbt.protocol.records import MemberRecord
from pbt.controller.store import CampaignStore

store = CampaignStore(sys.argv[1])
size = 200
store.add_members([MemberRecord(member_id=f"g0000-m{i:03d}", generation=0) for i in range(size)])
for g in range(100000):
    finished = [MemberRecord(member_id=f"g{g:04d}-m{i:03d}", generation=g, status="done",
                             fitness_history=[float(g)]) for i in range(size)]
    nxt = [MemberRecord(member_id=f"g{g + 1:04d}-m{i:03d}", generation=g + 1,
                        parent_id=f"g{g:04d}-m{i:03d}") for i in range(size)]
    events = [{"kind": "clone", "member_id": m.member_id, "parent_id": m.parent_id} for m in nxt]
    store.commit_generation(g, finished, nxt, events, {"rng": g}, None)
    if g == 2:
        print("going", flush=True)
"""


def test_sigkill_during_a_commit_loop_leaves_whole_generations(tmp_path: Path):
    path = tmp_path / "c.db"
    writer = subprocess.Popen(
        [sys.executable, "-c", _LOOPING_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "going"
    time.sleep(0.3)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    with CampaignStore(path) as store:
        last = store.last_committed_generation()
        assert last is not None and last >= 2
        assert store.controller_state(last) == {"rng": last}
        for generation in range(last + 1):
            members = store.members(generation)
            assert len(members) == 200 and {m.status for m in members} == {"done"}
        assert len(store.members(last + 1)) == 200
        assert store.members(last + 2) == []
        assert len(store.lineage()) == 200 * (last + 1)


def test_checkpoint_references_follow_the_current_generation_pending_parents_and_the_best(
    tmp_path: Path,
):
    with CampaignStore(tmp_path / "c.db") as store:
        # g000-m01 scores 10 once and stays the campaign's best; its clones never beat it.
        _run_generations(store, {0: [1.0, 10.0], 1: [2.0, 3.0], 2: [4.0, 5.0]})
        store.register_checkpoint("ckpt/stray-attempt", "sha256:stray")
        assert "ckpt/stray-attempt" not in store.unreferenced_checkpoints()
        # gen 2 done, gen 3 pending: gen 2's checkpoints (gen 3's parents) and the best stay
        assert store.unreferenced_checkpoints() == [
            "ckpt/g000-m00",
            "ckpt/g001-m00",
            "ckpt/g001-m01",
        ]
        current = store.members(3)
        finished = [_finish(m, 6.0 + i) for i, m in enumerate(current)]
        next_members = [_member(4, i, p) for i, p in enumerate(finished)]
        store.commit_generation(3, finished, next_members, [], {}, ("g003-m01", 7.0))
        # Gen 3 done, gen 4 pending: gen 3's own checkpoints (also gen 4's parents) and
        # g000-m01 as the best by last fitness (10.0); gen 2's are needed no more.
        assert store.best() == ("g000-m01", 10.0)
        unreferenced = [
            "ckpt/g000-m00",
            "ckpt/g001-m00",
            "ckpt/g001-m01",
            "ckpt/g002-m00",
            "ckpt/g002-m01",
            "ckpt/stray-attempt",
        ]
        assert store.unreferenced_checkpoints() == unreferenced
        with pytest.raises(PbtError, match="ckpt/g003-m00 is still referenced"):
            store.forget_checkpoint("ckpt/g003-m00")
        for path in unreferenced:
            store.forget_checkpoint(path)
    with CampaignStore(tmp_path / "c.db") as reopened:
        assert reopened.unreferenced_checkpoints() == []


def test_faults_and_lineage_keep_their_order(tmp_path: Path):
    with CampaignStore(tmp_path / "c.db") as store:
        store.add_members([_member(0, 0), _member(0, 1)])
        store.record_fault(0, "g000-m01", 1, "timeout", "no heartbeat for 600 s")
        store.record_fault(0, "g000-m00", 1, "crash", "exit code 137")
        store.record_fault(0, "g000-m01", 2, "no-result", "result.json missing")
        events = [
            {"kind": "elite", "member_id": "g001-m00", "parent_id": "g000-m00"},
            {
                "kind": "mutate",
                "member_id": "g001-m01",
                "parent_id": "g000-m00",
                "detail": "lr x1.2",
            },
            {
                "kind": "replace",
                "member_id": "g000-m01",
                "generation": 0,
                "detail": {"attempts": 2},
            },
        ]
        parent = _finish(_member(0, 0), 1.0)
        failed = _member(0, 1)
        failed.status = "failed"
        next_members = [_member(1, 0, parent), _member(1, 1, parent)]
        store.commit_generation(0, [parent, failed], next_members, events, {}, None)
        store.record_fault(1, "g001-m00", 1, "crash", "oom")
        faults = store.faults()
        assert [(f["member_id"], f["attempt"], f["kind"]) for f in faults] == [
            ("g000-m01", 1, "timeout"),
            ("g000-m00", 1, "crash"),
            ("g000-m01", 2, "no-result"),
            ("g001-m00", 1, "crash"),
        ]
        assert [f["kind"] for f in store.faults(1)] == ["crash"]
        lineage = store.lineage()
        assert [(e["kind"], e["member_id"], e["detail"]) for e in lineage] == [
            ("elite", "g001-m00", None),
            ("mutate", "g001-m01", "lr x1.2"),
            ("replace", "g000-m01", {"attempts": 2}),
        ]
        assert [e["generation"] for e in lineage] == [0, 0, 0]
        assert [e["parent_id"] for e in lineage] == ["g000-m00", "g000-m00", None]


def test_threads_share_one_store(tmp_path: Path):
    with CampaignStore(tmp_path / "c.db") as store:
        store.add_members([_member(0, i) for i in range(4)])

        def report(index: int) -> None:
            for attempt in range(25):
                store.record_fault(0, f"g000-m{index:02d}", attempt, "crash", "exit 1")

        threads = [threading.Thread(target=report, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        faults = store.faults(0)
        assert len(faults) == 100
        for index in range(4):
            mine = [f["attempt"] for f in faults if f["member_id"] == f"g000-m{index:02d}"]
            assert mine == list(range(25))


def test_newer_schema_is_refused(tmp_path: Path):
    CampaignStore(tmp_path / "c.db").close()
    with sqlite3.connect(tmp_path / "c.db") as db:
        db.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(PbtError, match=r"schema_version 999, newer than .* upgrade pbt-llm"):
        CampaignStore(tmp_path / "c.db")


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path):
    (tmp_path / "c.db").write_text("not sqlite at all, just text " * 100)
    with pytest.raises(PbtError, match="not a usable SQLite database"):
        CampaignStore(tmp_path / "c.db")


def test_store_imports_no_torch():
    code = "import sys, pbt.controller.store; assert 'torch' not in sys.modules, 'pbt.controller.store imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
