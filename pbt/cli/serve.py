"""Serve a campaign's tracking store and studies on localhost: the MLflow UI and
optuna-dashboard. Both bind 127.0.0.1 only; neither is needed for training.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pbt.config.errors import PbtError
from pbt.config.loader import manifest_from_dict
from pbt.controller.search import study_storage
from pbt.controller.store import CampaignStore
from pbt.controller.tracking import default_uri


def tracking_uri(directory: Path) -> str:
    """The MLflow store a campaign (or a ``train_population`` output folder) logs to.

    Raises:
        PbtError: the folder has no embedded store and names no tracking server.
    """

    store = directory / "store.db"
    if store.exists():
        with CampaignStore(store) as campaign:
            raw = campaign.load_config()
        if raw is not None:
            manifest = manifest_from_dict(raw["manifest"], base_dir=raw["base_dir"])
            if not manifest.tracking.enabled:
                raise PbtError(f"{directory} was run with tracking.enabled: false; nothing logged")
            if manifest.tracking.uri:
                return manifest.tracking.uri
    if not (directory / "mlflow.db").exists():
        raise PbtError(f"{directory} holds no MLflow store (mlflow.db); is it a campaign folder?")
    return default_uri(directory)


def mlflow_command(uri: str, port: int) -> list[str]:
    """The command that serves the MLflow UI on ``uri``, on localhost only."""
    return [
        sys.executable,
        *("-m", "mlflow", "server", "--backend-store-uri", uri),
        *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
    ]


def serve_mlflow(directory: Path, port: int) -> int:
    """Run the MLflow UI on the campaign's store until interrupted."""
    uri = tracking_uri(directory)
    if not uri.startswith("sqlite:"):
        print(f"{directory} logs to the tracking server {uri}: open it there")
        return 0
    print(f"MLflow UI on {uri}: http://127.0.0.1:{port} (Ctrl-C to stop)", flush=True)
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    return _foreground(mlflow_command(uri, port), env)


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


def _foreground(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(command, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=30)
        return 0
