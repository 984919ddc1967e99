"""Shared fixtures of tests/: a real MLflow server (the offline model cache is the repository's
conftest.py, for bench/tests/ too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import MlflowServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` on localhost for one test, always stopped afterwards."""
    server = MlflowServer(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()
