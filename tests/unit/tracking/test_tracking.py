"""The tracker on real MLflow stores: an embedded SQLite file, and a real server that goes away.

One SQLite store is shared by the module (creating one costs seconds); each test uses its own
experiment. Nothing of MLflow is faked.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support import REPO, MlflowServer, free_port

from pbt.config.errors import PbtError
from pbt.tracking.tracker import Tracker, default_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient

SEND_TIMEOUT_S = 60.0


@pytest.fixture(scope="module", autouse=True)
def _no_telemetry() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return default_uri(tmp_path_factory.mktemp("mlflow"))


@pytest.fixture
def experiment(request: pytest.FixtureRequest) -> str:
    return request.node.name


def _client(uri: str) -> MlflowClient:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _steps(uri: str, run_id: str, metric: str) -> list[tuple[int, float]]:
    history = _client(uri).get_metric_history(run_id, metric)
    return sorted((m.step, m.value) for m in history)


def _runs(uri: str, experiment: str) -> list:
    client = _client(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def test_default_uri_is_an_absolute_sqlite_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_uri("runs/a") == f"sqlite:///{tmp_path}/runs/a/mlflow.db"
    assert default_uri("runs/a").startswith("sqlite:////")


def test_parent_and_children_arrive_whole(store: str, experiment: str, tmp_path: Path) -> None:
    plot = tmp_path / "plot.txt"
    plot.write_text("generation 0")
    lineage = tmp_path / "lineage"
    (lineage / "g000").mkdir(parents=True)
    (lineage / "g000" / "m00.json").write_text("{}")
    with Tracker(store, experiment, tmp_path / "journal") as tracker:
        tracker.start_run("population", name="campaign", tags={"kind": "population"})
        for member in ("g000-m00", "g000-m01"):
            tracker.start_run(member, name=member, parent="population", params={"lr": 1e-4})
            for step in range(30):
                tracker.log_metrics(member, {"loss": 1.0 / (step + 1), "lr": 1e-4}, step)
            tracker.set_tags(member, {"parent_member": "none"})
        tracker.log_params("population", {"population_size": 2})
        tracker.log_artifact("population", plot, artifact_path="plots")
        tracker.log_artifact("population", lineage)
        plot.write_text("changed after logging")
        for member in ("g000-m00", "g000-m01"):
            tracker.end_run(member)
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        assert tracker.pending == 0
        ids = {key: tracker.run_id(key) for key in ("population", "g000-m00", "g000-m01")}

    client = _client(store)
    parent = client.get_run(ids["population"])
    assert parent.info.run_name == "campaign"
    assert parent.data.tags["kind"] == "population"
    assert parent.data.params == {"population_size": "2"}
    assert parent.info.status == "RUNNING"
    for member in ("g000-m00", "g000-m01"):
        run = client.get_run(ids[member])
        assert run.info.experiment_id == parent.info.experiment_id
        assert run.data.tags["mlflow.parentRunId"] == ids["population"]
        assert run.data.tags["parent_member"] == "none"
        assert run.data.params == {"lr": "0.0001"}
        assert run.info.status == "FINISHED"
        assert _steps(store, ids[member], "loss") == [(s, 1.0 / (s + 1)) for s in range(30)]
    assert [f.path for f in client.list_artifacts(ids["population"], "plots")] == ["plots/plot.txt"]
    assert [f.path for f in client.list_artifacts(ids["population"], "lineage/g000")] == [
        "lineage/g000/m00.json"
    ]
    local = client.download_artifacts(ids["population"], "plots/plot.txt", str(tmp_path))
    assert Path(local).read_text() == "generation 0"
    assert list((tmp_path / "journal" / "artifacts").iterdir()) == []  # copies go once sent


def test_programming_errors_raise_and_a_journal_has_one_owner(
    store: str, experiment: str, tmp_path: Path
) -> None:
    with Tracker(store, experiment, tmp_path) as tracker:
        with pytest.raises(ValueError, match=r"start_run\('m0'"):
            tracker.log_metrics("m0", {"loss": 1.0}, 0)
        with pytest.raises(ValueError, match="parent"):
            tracker.start_run("m0", name="m0", parent="population")
        tracker.start_run("m0", name="m0")
        with pytest.raises(ValueError, match="FINISHED"):
            tracker.end_run("m0", status="DONE")
        with pytest.raises(TypeError, match=r"'loss'.*number"):
            tracker.log_metrics("m0", {"loss": "low"}, 0)
        with pytest.raises(PbtError, match="in use"):
            Tracker(store, experiment, tmp_path)
        tracker.log_artifact("m0", tmp_path / "missing.txt")  # warns, does not raise
        assert tracker.pending == 1
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log_metrics("m0", {"loss": 1.0}, 0)


def test_start_run_reuses_the_run_of_a_key(store: str, experiment: str, tmp_path: Path) -> None:
    with Tracker(store, experiment, tmp_path) as tracker:
        tracker.start_run("population", name="campaign")
        tracker.start_run("population", name="campaign")
        tracker.end_run("population")
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        first = tracker.run_id("population")
    with Tracker(store, experiment, tmp_path) as tracker:  # a resumed campaign
        tracker.log_metrics("population", {"best": 1.0}, 5)  # known from the journal
        tracker.start_run("population", name="campaign")
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        assert tracker.run_id("population") == first
    assert [r.info.run_id for r in _runs(store, experiment)] == [first]
    assert _client(store).get_run(first).info.status == "RUNNING"


def test_a_new_tracker_sends_what_an_unreachable_one_left(
    store: str, experiment: str, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    journal = tmp_path / "journal"
    tracker = Tracker(down, experiment, journal)
    tracker.start_run("population", name="campaign")
    tracker.start_run("m0", name="m0", parent="population")
    for step in range(200):
        tracker.log_metrics("m0", {"reward": float(step)}, step)
    tracker.end_run("m0", status="FAILED")
    assert not tracker.close(timeout=1.0)
    assert tracker.pending == 203
    assert tracker.run_id("m0") is None

    with Tracker(store, experiment, journal) as resumed:
        assert resumed.recovered == 203  # `pending` falls as soon as its thread sends
        assert resumed.flush(timeout=SEND_TIMEOUT_S)
        run_id = resumed.run_id("m0")
    assert _steps(store, run_id, "reward") == [(s, float(s)) for s in range(200)]
    run = _client(store).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["mlflow.parentRunId"] == resumed.run_id("population")
    assert len(_runs(store, experiment)) == 2
    assert json.loads((journal / "sent").read_text())["lines"] == 203


_CRASHING_MEMBER = """
import os, signal, sys
from pbt.tracking.tracker import Tracker

tracker = Tracker(sys.argv[1], sys.argv[2], sys.argv[3])
tracker.start_run("population", name="campaign")
tracker.start_run("m0", name="m0", parent="population")
for step in range(50):
    tracker.log_metrics("m0", {"reward": float(step)}, step)
os.kill(os.getpid(), signal.SIGKILL)  # dies before its thread has even imported mlflow
"""


def test_a_crash_between_log_and_send_loses_and_duplicates_nothing(
    store: str, experiment: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal"
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASHING_MEMBER, store, experiment, str(journal)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    with open(journal / "journal.jsonl", "ab") as f:
        f.write(b'{"op":"metrics","key":"m0","metr')  # a write torn by the crash

    with Tracker(store, experiment, journal) as resumed:
        assert resumed.recovered == 52  # the torn line is not an event
        resumed.log_metrics("m0", {"reward": 50.0}, 50)  # not glued onto the torn line
        assert resumed.flush(timeout=SEND_TIMEOUT_S)
        run_id = resumed.run_id("m0")
    assert _steps(store, run_id, "reward") == [(s, float(s)) for s in range(51)]

    # The acknowledgements are lost after the sends: a replay duplicates nothing.
    (journal / "sent").write_text('{"lines": 0, "offset": 0}')
    with Tracker(store, experiment, journal) as replay:
        assert replay.recovered == 53  # everything is sent again
        assert replay.flush(timeout=SEND_TIMEOUT_S)
        assert replay.run_id("m0") == run_id
    assert _steps(store, run_id, "reward") == [(s, float(s)) for s in range(51)]
    assert len(_runs(store, experiment)) == 2


def test_an_emptied_journal_resumes(
    store: str, experiment: str, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr("pbt.tracking.tracker._COMPACT_BYTES", 1)
    with Tracker(store, experiment, tmp_path) as tracker:
        tracker.start_run("m0", name="m0")
        tracker.log_metrics("m0", {"x": 0.0}, 0)
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        assert (tmp_path / "journal.jsonl").stat().st_size == 0
        tracker.log_metrics("m0", {"x": 1.0}, 1)
    with Tracker(store, experiment, tmp_path) as tracker:
        tracker.log_metrics("m0", {"x": 2.0}, 2)
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        run_id = tracker.run_id("m0")
    assert _steps(store, run_id, "x") == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_inherited_run_and_experiment_ids_do_not_hijack(
    store: str, experiment: str, tmp_path: Path, monkeypatch
) -> None:
    client = _client(store)
    other = client.create_experiment(f"{experiment}-other")
    outsider = client.create_run(other).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", outsider)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", other)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"{experiment}-other")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/elsewhere.db")
    with Tracker(store, experiment, tmp_path / "journal") as tracker:
        tracker.start_run("population", name="campaign")
        tracker.log_metrics("population", {"best": 0.5}, 0)
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        run_id = tracker.run_id("population")
    assert run_id != outsider
    assert (
        client.get_run(run_id).info.experiment_id
        == client.get_experiment_by_name(experiment).experiment_id
    )
    assert client.get_run(outsider).data.metrics == {}
    assert not (tmp_path / "elsewhere.db").exists()


def test_nan_is_kept_and_a_refused_param_is_skipped(
    store: str, experiment: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pbt.tracking.tracker")
    with Tracker(store, experiment, tmp_path) as tracker:
        tracker.start_run("m0", name="m0", params={"lr": 1e-4, "group_size": 4})
        tracker.log_metrics("m0", {"loss": math.nan, "kl": math.inf, "reward": 1.0}, 0)
        tracker.log_params("m0", {"lr": 1e-4})  # the same value again: fine
        tracker.log_params("m0", {"lr": 2e-4, "seed": 7})  # lr changed: refused, seed kept
        tracker.log_metrics("m0", {"loss": 0.5, "reward": 2.0}, 1)
        tracker.set_tags("m0", {"after": "refusal"})
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        run_id = tracker.run_id("m0")
    loss = _steps(store, run_id, "loss")
    assert math.isnan(loss[0][1]) and loss[1] == (1, 0.5)
    assert _steps(store, run_id, "reward") == [(0, 1.0), (1, 2.0)]
    assert _steps(store, run_id, "kl")[0][1] > 1e300  # SQL has no inf: MLflow stores the max
    run = _client(store).get_run(run_id)
    assert run.data.params == {"lr": "0.0001", "group_size": "4", "seed": "7"}
    assert run.data.tags["after"] == "refusal"
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "'lr'" in refused[0], refused


@pytest.mark.integration
def test_a_server_outage_loses_nothing_and_blocks_nothing(
    server: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pbt.tracking.tracker")
    tracker = Tracker(server.uri, "outage", tmp_path / "journal")
    try:
        tracker.start_run("population", name="campaign")
        tracker.start_run("m0", name="m0", parent="population", params={"lr": 1e-4})
        step = 0
        for step in range(20):
            tracker.log_metrics("m0", {"reward": float(step), "loss": math.nan}, step)
        assert tracker.flush(timeout=SEND_TIMEOUT_S)

        server.stop()
        slowest = 0.0
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            step += 1
            began = time.perf_counter()
            tracker.log_metrics("m0", {"reward": float(step), "loss": math.nan}, step)
            slowest = max(slowest, time.perf_counter() - began)
            time.sleep(0.02)
        assert slowest < 0.05
        assert tracker.pending > 0
        assert not tracker.flush(timeout=0.5)

        server.start()
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        tracker.end_run("m0")
        assert tracker.close(timeout=SEND_TIMEOUT_S)
    finally:
        tracker.close(timeout=0)
    run_id = tracker.run_id("m0")
    assert _steps(server.uri, run_id, "reward") == [(s, float(s)) for s in range(step + 1)]
    assert len(_steps(server.uri, run_id, "loss")) == step + 1
    run = _client(server.uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.0001"}
    messages = [r.getMessage() for r in caplog.records if r.name == "pbt.tracking.tracker"]
    assert sum("unreachable" in m for m in messages) == 1, messages
    assert sum("reachable again" in m for m in messages) == 1, messages


_CREATE_STORE = """
import sys
from pbt.tracking.tracker import _create_sqlite_store
_create_sqlite_store(sys.argv[1], None)
"""


def test_an_embedded_store_killed_while_it_is_built_is_built_again(tmp_path: Path) -> None:
    """MLflow builds a new SQLite store migration by migration. A process SIGKILLed during them
    leaves either no store or a whole one, never a half-built one, and the next tracker works."""
    uri = default_uri(tmp_path)
    target = tmp_path / "mlflow.db"
    builder = subprocess.Popen([sys.executable, "-c", _CREATE_STORE, uri], cwd=REPO)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob(".mlflow.db.creating-*")):
        time.sleep(0.01)
    assert list(tmp_path.glob(".mlflow.db.creating-*")), "the store was not being built"
    time.sleep(0.3)  # into the migrations
    builder.kill()
    builder.wait(timeout=30)
    assert not target.exists(), "a store killed while it was built must not be in place"
    with Tracker(uri, "after-a-kill", tmp_path / "journal") as tracker:
        tracker.start_run("m0", name="m0")
        tracker.log_metrics("m0", {"reward": 1.0}, 0)
        assert tracker.flush(timeout=SEND_TIMEOUT_S)
        run_id = tracker.run_id("m0")
    assert _steps(uri, run_id, "reward") == [(0, 1.0)]
    assert not list(tmp_path.glob(".mlflow.db.creating-*")), "the killed build was left behind"
