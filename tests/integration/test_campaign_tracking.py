"""Campaigns in MLflow: against a real ``mlflow server`` on localhost (through an outage too), in
the embedded store (across a crash and resume), and through ``pbt ui`` (its processes found in
Linux's /proc), as a browser renders it. The fake member keeps each campaign to seconds."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support import DRIVERS, free_port, start_campaign, write_manifest

from pbt.config import manifest_from_dict
from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore
from pbt.tracking.run_schema import config_params
from pbt.tracking.tracker import _HTTP_ENV, MAX_BACKOFF_S, default_uri

pytestmark = pytest.mark.integration

FAKE = [sys.executable, str(DRIVERS / "fake_member.py")]
MANIFEST = {
    "INIT_HP": {"TOURNAMENT_SIZE": 2, "EVO_STEPS": 2, "LR": 1e-4},
    "population": {"size": 3, "init_sampler": "random"},
    "mutation": {"rl_hp": 1.0, "ranges": {"lr": {"min": 1e-5, "max": 1e-1, "log": True}}},
    "budget": {"generations": 3},
    "launch": {"slots": 3, "persistent_workers": False},
    "training": {"seed": 11},
}


def _manifest(tmp_path: Path, **changes) -> Path:
    return write_manifest(tmp_path / "manifest.yaml", MANIFEST, **changes)


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _campaign_runs(uri: str, directory: Path) -> dict:
    client = _client(uri)
    experiment = client.get_experiment_by_name(f"campaign {directory.resolve()}")
    assert experiment is not None, [e.name for e in client.search_experiments()]
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    return {r.info.run_name: r for r in runs}


def _members(directory: Path):
    with CampaignStore(directory / "store.db") as store:
        return store.members()


def _check_everything_arrived(uri: str, directory: Path, generations: int = 3) -> None:
    client = _client(uri)
    runs = _campaign_runs(uri, directory)
    members = _members(directory)
    parent = runs.pop(directory.name)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["training.seed"] == "11"
    assert parent.data.params["population.size"] == "3" and "version" in parent.data.params
    assert set(runs) == {m.member_id for m in members}
    for generation in range(generations):
        slots = [m for m in members if m.generation == generation]
        for m in slots:
            run = runs[m.member_id]
            assert run.info.status == "FINISHED", m.member_id
            assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
            assert run.data.tags["generation"] == str(generation)
            assert run.data.tags["parent_member"] == (m.parent_id or "")
            assert run.data.tags["mutation"] == (m.mutation or "initial")
            assert run.data.params == {k: str(v) for k, v in m.hyperparameters.items()}
            steps = [x.step for x in client.get_metric_history(run.info.run_id, "reward_mean")]
            assert steps == list(range(m.steps - 1, m.steps + 1))  # evo_steps = 2 per task
            (fitness,) = client.get_metric_history(run.info.run_id, "fitness")
            assert fitness.value == pytest.approx(m.fitness_history[-1]) and fitness.step == m.steps
            (lr,) = client.get_metric_history(run.info.run_id, "lr")[-1:]
            assert lr.value == pytest.approx(m.hyperparameters["lr"])
    # per generation on the campaign run: every slot's fitness and hyperparameters by step
    for slot in ("m00", "m01", "m02"):
        history = client.get_metric_history(parent.info.run_id, f"{slot}.lr")
        assert [x.step for x in history] == list(range(generations))
        assert [x.step for x in client.get_metric_history(parent.info.run_id, f"{slot}.fitness")]
    best = client.get_metric_history(parent.info.run_id, "best_fitness")
    assert [x.step for x in best] == list(range(generations))
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"manifest.yaml", "plots"} <= artifacts
    plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert plots == {"plots/fitness.png", "plots/hyperparameters.png", "plots/lineage.png"}


def _run(manifest: Path, directory: Path) -> None:
    campaign = Campaign.start(manifest, directory, member_command=FAKE)
    campaign.say = lambda *_: None
    try:
        campaign.run()
    finally:
        campaign.close()


def test_campaign_logs_to_a_real_mlflow_server(tmp_path, server, monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "0123456789abcdef0123456789abcdef")  # must not hijack
    directory = tmp_path / "c"
    _run(_manifest(tmp_path, tracking={"uri": server.uri}), directory)
    _check_everything_arrived(server.uri, directory)


def _committed(directory: Path) -> int:
    """The campaign's last committed generation; -1 before generation 0 is."""
    if not (directory / "store.db").exists():
        return -1
    with CampaignStore(directory / "store.db") as store:
        last = store.last_committed_generation()
    return -1 if last is None else last


OUTAGE_S = 5 * MAX_BACKOFF_S
"""Five times the longest wait between two attempts to reach MLflow, and over twice the HTTP
timeout the tracker sets: the tracker is at its longest backoff for most of the outage."""
MEMBER_S = 3.0


def test_campaign_survives_a_tracking_outage_of_many_retries(tmp_path, server):
    """The server is down for five times the tracker's longest backoff, from the end of
    generation 0: the campaign trains on without waiting (three or more generations commit
    while nothing answers; it neither stops nor finishes), and once the server is back every
    run, tag and metric arrives."""
    assert 2 * float(_HTTP_ENV["MLFLOW_HTTP_REQUEST_TIMEOUT"]) < OUTAGE_S
    directory = tmp_path / "c"
    manifest = _manifest(tmp_path, tracking={"uri": server.uri}, budget={"generations": 8})
    proc = start_campaign(manifest, directory, FAKE, MEMBER_S, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while _committed(directory) < 0:  # until generation 0 is committed
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    server.stop()
    down = time.monotonic()
    time.sleep(OUTAGE_S)
    during = _committed(directory)
    assert proc.poll() is None, "the campaign stopped, or finished, while the server was down"
    server.start()
    downtime = time.monotonic() - down
    assert downtime >= OUTAGE_S
    # a generation takes MEMBER_S seconds of training: a controller waiting on the server
    # would have committed fewer
    assert during >= 3, f"{during} generations committed in {downtime:.0f} s of outage"
    assert proc.wait(timeout=300) == 0
    _check_everything_arrived(server.uri, directory, generations=8)


def test_a_resumed_campaign_keeps_its_params_and_nothing_is_refused(tmp_path, caplog):
    """Killed after generation 1 trained, then resumed (its configuration read back from the
    store, keys sorted): the runs hold the params logged at the start, MLflow refused nothing,
    and everything arrived in the embedded store."""
    directory = tmp_path / "c"
    manifest = tmp_path / "manifest.yaml"  # keys as a person writes them, not sorted
    manifest.write_text(yaml.safe_dump(MANIFEST, sort_keys=False))
    assert list(MANIFEST["mutation"]["ranges"]["lr"]) != sorted(
        MANIFEST["mutation"]["ranges"]["lr"]
    )
    crash = {"PBT_CRASH_AT": "selection:2"}
    killed = start_campaign(manifest, directory, FAKE, 0.05, env=crash, stdout=subprocess.DEVNULL)
    assert killed.wait(timeout=120) == -signal.SIGKILL
    assert _committed(directory) == 0
    with caplog.at_level(logging.WARNING, logger="pbt.tracking.tracker"):
        resumed = Campaign.resume(directory, member_command=FAKE)
        resumed.say = lambda *_: None
        try:
            resumed.run()
        finally:
            resumed.close()
    assert not [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    uri = default_uri(directory)
    _check_everything_arrived(uri, directory)
    started = manifest_from_dict(yaml.safe_load(manifest.read_text()), base_dir=str(tmp_path))
    with CampaignStore(directory / "store.db") as store:
        raw = store.load_config()
    stored = manifest_from_dict(raw["manifest"], base_dir=raw["base_dir"])
    assert config_params(stored) == config_params(started)  # the same text either way
    assert _campaign_runs(uri, directory)[directory.name].data.params == config_params(started)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small finished campaign logged to its embedded store, read by the ``pbt ui`` tests."""
    directory = tmp_path_factory.mktemp("ui") / "campaign-ui"
    _run(_manifest(directory.parent), directory)
    return directory


class _Ui:
    """``pbt ui DIR`` in a subprocess, with a ``BROWSER`` that only writes down what it was
    asked to open."""

    def __init__(self, directory: Path, tmp_path: Path) -> None:
        self.port = free_port()
        self.opened = tmp_path / "opened"
        browser = tmp_path / "browser"
        browser.write_text(f'#!/bin/sh\necho "$1" >> {self.opened}\n')
        browser.chmod(0o755)
        command = [sys.executable, "-m", "pbt.cli", "ui", str(directory), "--port", str(self.port)]
        self.proc = subprocess.Popen(
            command, env=os.environ | {"BROWSER": f"{browser} %s"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.server: set[int] = set()
        """The processes below it once its server answered."""
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def page(self, timeout: float = 240.0) -> str:
        """The page it printed once its server answered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.startswith("MLflow UI: "):
                    self.server = _descendants(self.proc.pid)
                    return line.split()[2]
            assert self.proc.poll() is None, "".join(self.lines)[-3000:]
            time.sleep(0.2)
        raise TimeoutError(f"pbt ui printed no page in {timeout} s: {''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        """SIGTERM it, then SIGKILL whatever of it is left."""
        left = self.server | _descendants(self.proc.pid)
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        for pid in {self.proc.pid, *left}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid``, from /proc."""
    children: dict[int, set[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), set()).add(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        below = children.get(todo.pop(), set()) - found
        found |= below
        todo += below
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, waiting to be reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def ui(finished: Path, tmp_path: Path) -> Iterator[_Ui]:
    ui = _Ui(finished, tmp_path)
    try:
        yield ui
    finally:
        ui.stop()


def _experiment_id(directory: Path) -> str:
    runs = _campaign_runs(default_uri(directory), directory)
    return next(iter(runs.values())).info.experiment_id


def test_pbt_ui_opens_the_campaigns_runs_and_sigterm_stops_its_server(finished, ui):
    page = ui.page()
    assert page == f"http://127.0.0.1:{ui.port}/#/experiments/{_experiment_id(finished)}/runs"
    deadline = time.monotonic() + 30
    while not (ui.opened.exists() and ui.opened.read_text().split()):
        assert time.monotonic() < deadline, "pbt ui opened no browser"
        time.sleep(0.1)
    assert ui.opened.read_text().split() == [page]
    server = ui.server  # mlflow server and its uvicorn
    assert len(server) >= 2, server
    ui.proc.send_signal(signal.SIGTERM)
    assert ui.proc.wait(timeout=20) == 0
    deadline = time.monotonic() + 5
    while {pid for pid in server if _running(pid)} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {pid for pid in server if _running(pid)}, "the mlflow server outlived pbt ui"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{ui.port}/health", timeout=2)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (./dev test installs it)")
def test_the_page_pbt_ui_opens_shows_the_campaign(finished, ui):
    assert len(_campaign_runs(default_uri(finished), finished)) == 1 + 3 * 3
    text = _render(ui.page(), must_contain="10 matching runs")
    # the campaign's run is listed, its 9 member runs nested under it
    assert "campaign-ui" in text and f"campaign {finished.resolve()}" in text


def _render(url: str, must_contain: str, attempts: int = 4) -> str:
    """The page's text after its scripts ran, in headless Chromium (the UI loads runs lazily:
    retry with a longer budget until ``must_contain`` is there)."""
    text = ""
    for attempt in range(attempts):
        out = subprocess.run(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--virtual-time-budget={15000 * (attempt + 1)}", "--dump-dom", url,
            ],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        dom = re.sub(r"<(style|script)\b.*?</\1>", " ", out.stdout, flags=re.S)
        text = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
        if must_contain in text:
            return text
    raise AssertionError(f"{must_contain!r} never rendered; the page said: {text[:1500]}")
