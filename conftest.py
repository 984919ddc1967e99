"""Fixtures for every test folder (tests/ and bench/tests/): one tiny model per test session,
offline, in a private cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


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
