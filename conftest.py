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
