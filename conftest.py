"""Fixtures for every test folder (tests/ and bench/tests/): one tiny model per test session,
offline, in a private cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch gets the cores divided by the workers (one each
    on two cores with ``-n 2``), and its subprocesses inherit as much, unless
    ``OMP_NUM_THREADS`` is set: two workers with torch's default pool each (a thread a core)
    spin against each other, and took 85 s for the seven learning tests of
    ``test_algorithms.py`` that take 15 s with a thread each (16 s one test at a time)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or os.environ.get("OMP_NUM_THREADS"):
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # imported already (by a plugin): its pool is not started yet
        sys.modules["torch"].set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Point the model cache at a session folder and forbid hub access (subprocesses inherit)."""
    cache = tmp_path_factory.mktemp("pbt-cache")
    os.environ["PBT_CACHE_DIR"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return cache


SHARED_SCOPES = ("class", "module", "package")
"""Fixture scopes that several tests of one file read: under pytest-xdist such tests run on one
worker, so the fixture is built once."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test for ``pytest -n N --dist loadgroup`` (``.ci/run``): the Slurm tests in one
    group (they share the session's cluster and cancel every job on it after each test), tests
    that use a file-scoped fixture grouped by file; the rest go to whichever worker is free."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = _xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def _xdist_group(item: pytest.Item) -> str | None:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    if "slurm_cluster_conf" in info.names_closure:
        return "slurm"
    for defs in info.name2fixturedefs.values():
        if any(fixture.scope in SHARED_SCOPES for fixture in defs):
            return item.path.stem
    return None
