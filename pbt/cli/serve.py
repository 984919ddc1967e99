"""Serve a campaign's tracking store and studies on localhost: the MLflow UI and
optuna-dashboard. Both bind 127.0.0.1 only; neither is needed for training.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import webbrowser
from collections.abc import Iterator
from pathlib import Path

from pbt.config.errors import PbtError
from pbt.config.read.loader import manifest_from_dict
from pbt.controller.store import CampaignStore
from pbt.evolution.search import study_storage
from pbt.tracking.run_schema import campaign_experiment, population_experiment
from pbt.tracking.tracker import default_uri

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Besides Ctrl-C: what ``kill`` sends by default, and a closed terminal."""
_ANSWER_S = 5.0
"""How long one request to an MLflow server may take."""


def tracking_uri(directory: Path) -> str:
    """The MLflow store a campaign (or a ``train_population`` output folder) logs to.

    Raises:
        PbtError: the folder has no embedded store and names no tracking server.
    """
    return _tracking(directory)[0]


def _tracking(directory: Path) -> tuple[str, str]:
    """The store and the experiment a campaign (or a population's output folder) logs to."""
    store = directory / "store.db"
    experiment = population_experiment(directory)
    if store.exists():
        with CampaignStore(store) as campaign:
            raw = campaign.load_config()
        if raw is not None:
            manifest = manifest_from_dict(raw["manifest"], base_dir=raw["base_dir"])
            if not manifest.tracking.enabled:
                raise PbtError(f"{directory} was run with tracking.enabled: false; nothing logged")
            experiment = campaign_experiment(directory, manifest)
            if manifest.tracking.uri:
                return manifest.tracking.uri, experiment
    if not (directory / "mlflow.db").exists():
        raise PbtError(f"{directory} holds no MLflow store (mlflow.db); is it a campaign folder?")
    return default_uri(directory), experiment


def mlflow_command(uri: str, port: int) -> list[str]:
    """The command that serves the MLflow UI on ``uri``, on localhost only."""
    return [
        sys.executable,
        *("-m", "mlflow", "server", "--backend-store-uri", uri),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
    ]


def runs_page(server: str, experiment: str) -> str | None:
    """The UI page listing ``experiment``'s runs on the MLflow ``server``; None when the server
    does not answer or has no such experiment."""
    if not server.startswith(("http://", "https://")):
        return None
    query = urllib.parse.urlencode({"experiment_name": experiment})
    url = f"{server.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}"
    try:
        with urllib.request.urlopen(url, timeout=_ANSWER_S) as response:
            found = json.load(response)["experiment"]["experiment_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"{server.rstrip('/')}/#/experiments/{found}/runs"


def serve_mlflow(directory: Path, port: int, open_browser: bool = True) -> int:
    """Run the MLflow UI on the campaign's store until interrupted (Ctrl-C, SIGTERM or SIGHUP
    stop the server too); once it answers, print its page of the campaign's runs and open it
    in a browser (``webbrowser``: the ``BROWSER`` variable chooses which)."""
    uri, experiment = _tracking(directory)
    if not uri.startswith("sqlite:"):
        page = runs_page(uri, experiment) or uri
        print(f"{directory} logs to the tracking server {uri}: open {page}")
        return 0
    base = f"http://127.0.0.1:{port}"
    print(f"MLflow UI on {uri}: starting at {base} ...", flush=True)
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    with _foreground(mlflow_command(uri, port), env) as server:
        if not _answers(base, server):
            return server.wait()
        page = runs_page(base, experiment) or base
        print(f"MLflow UI: {page} (Ctrl-C to stop)", flush=True)
        if open_browser:  # a console browser would hold this thread, and signals need it
            threading.Thread(target=webbrowser.open, args=(page,), daemon=True).start()
        return server.wait()
    return 0  # stopped by a signal or Ctrl-C


def serve_dashboard(directory: Path, port: int) -> int:
    """Run optuna-dashboard on the campaign's Optuna store until interrupted."""

    if not (directory / "optuna.db").exists():
        raise PbtError(
            f"{directory} holds no Optuna store (optuna.db): its campaign sampled nothing "
            "through Optuna (population.init_sampler: none and search.strategy: pbt)"
        )
    try:
        from optuna_dashboard import run_server
    except ImportError:
        raise PbtError(
            "optuna-dashboard is not installed; pip install 'pbt-llm[dashboard]'"
        ) from None
    storage = study_storage(directory)
    print(f"optuna-dashboard on {storage}: http://127.0.0.1:{port} (Ctrl-C to stop)", flush=True)
    run_server(storage, host="127.0.0.1", port=port)
    return 0


class _Stopped(Exception):
    """SIGTERM or SIGHUP arrived."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def _foreground(command: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """Run ``command`` in its own process group; on Ctrl-C, SIGTERM or SIGHUP (or any error)
    stop the whole group. ``mlflow server`` runs uvicorn as a child of its own: a server too
    slow to stop is killed with the group, so no uvicorn is left behind either way."""
    handlers = {sig: signal.signal(sig, _raise_stopped) for sig in _STOP_SIGNALS}
    proc = None
    try:
        proc = subprocess.Popen(command, env=env, start_new_session=True)
        yield proc
    except (KeyboardInterrupt, _Stopped):
        pass
    finally:
        for sig in _STOP_SIGNALS:  # a second SIGTERM must not cut the stopping short
            signal.signal(sig, signal.SIG_IGN)
        if proc is not None:
            _stop_group(proc)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _answers(base: str, proc: subprocess.Popen) -> bool:
    """Wait until the server at ``base`` answers its health check; False if it exited first."""
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=_ANSWER_S) as response:
                if response.status == 200:
                    return proc.poll() is None
        except OSError:
            time.sleep(0.2)
    return False


def _stop_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group, then SIGKILL whatever is left after ``timeout``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (an orphan's zombie
    lingers where PID 1 reaps nothing, as in some containers)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
                return True
    return False
