"""Helpers shared by tests."""

from __future__ import annotations

from pathlib import Path

from pbt.config import Manifest
from pbt.manifest import manifest_from_dict


def small_manifest(tmp_path: Path, **sections: dict) -> Manifest:
    """A fast manifest on the tiny model: 2 prompts x 4 completions x 6 tokens per step."""
    return manifest_from_dict(small_sections(tmp_path, **sections), base_dir=tmp_path)


def small_sections(tmp_path: Path, **sections: dict) -> dict:
    """The sections of :func:`small_manifest`, as a dict (for ``create_population(config=)``)."""
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
    return data
