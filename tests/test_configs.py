"""The manifests in configs/: each one loads, and the reference names every key at its default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from pbt.config import SECTIONS, Manifest, load_manifest
from pbt.worker.train import default_manifest_path

CONFIGS = Path(__file__).parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_manifest_is_valid(path: Path) -> None:
    assert isinstance(load_manifest(path), Manifest)


def test_the_quickstart_is_the_shipped_one() -> None:
    assert default_manifest_path().read_text() == (CONFIGS / "quickstart.yaml").read_text()


def test_the_reference_names_every_key_at_its_default() -> None:
    path = CONFIGS / "reference.yaml"
    written = yaml.safe_load(path.read_text())
    defaults = Manifest()
    assert list(written) == list(SECTIONS)
    for name in SECTIONS:
        section = dataclasses.asdict(getattr(defaults, name))
        assert written[name] == section, f"{path}: section {name} differs from the defaults"
    loaded = load_manifest(path)
    assert dataclasses.replace(loaded, base_dir=".") == defaults
