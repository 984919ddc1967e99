"""Shared fixtures: one tiny model per test session, offline, in a private cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pbt.manifest import manifest_from_dict


@pytest.fixture(scope="session", autouse=True)
def offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Point the model cache at a session folder and forbid hub access (subprocesses inherit)."""
    cache = tmp_path_factory.mktemp("pbt-cache")
    os.environ["PBT_CACHE_DIR"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    return cache


def small_manifest(tmp_path: Path, **sections: dict) -> object:
    """A fast manifest on the tiny model: 2 prompts x 4 completions x 6 tokens per step."""
    data = {
        "model": {"name": "builtin:tiny"},
        "optim": {"lr": 5e-3},
        "algorithm": {"group_size": 4, "prompts_per_step": 2},
        "rollout": {"max_output_tokens": 6},
        "task": {"name": "builtin:letters", "eval_size": 8},
        "training": {"steps": 4, "output_dir": str(tmp_path / "out"), "device": "cpu"},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return manifest_from_dict(data, base_dir=tmp_path)
