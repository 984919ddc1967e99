"""The manifests in configs/ (and the benchmarks' campaign manifest): each one loads (the examples' rows and rewards too), its canonical
form reads back to the same manifest, and the reference names every key at its default."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from support import REPO

from pbt.algorithms.data.rows import check_rows
from pbt.config import SECTIONS, Manifest, load_manifest
from pbt.config.read.canonical import canonical_sections, manifest_from_canonical, resolved_yaml
from pbt.worker.train import default_manifest_path

ROOT = REPO
CONFIGS = REPO / "configs"
OWN_TASK = CONFIGS / "examples" / "own_task"
MANIFESTS = [
    *CONFIGS.glob("*.yaml"),
    *CONFIGS.glob("examples/*/manifest.yaml"),
    ROOT / "bench" / "scale_campaign.yaml",
]


@pytest.mark.parametrize("path", sorted(MANIFESTS), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_manifest_is_valid(path: Path) -> None:
    """What ``pbt check`` does: the manifest loads (a reward file is parsed, not run), and the
    first rows of the files it names have the fields it reads."""
    manifest = load_manifest(path)
    assert isinstance(manifest, Manifest)
    assert check_rows(manifest.task, manifest.base_dir, manifest.algorithm.name) == []


@pytest.mark.parametrize("path", sorted(MANIFESTS), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_manifest_reads_back_from_its_canonical_form(path: Path) -> None:
    """What a campaign hands its members (JSON) and ``pbt check --resolved`` prints (YAML)
    loads to a manifest equal in every compared field (all but ``translation_notes``)."""
    manifest = load_manifest(path)
    as_json = json.loads(json.dumps(canonical_sections(manifest)))
    assert manifest_from_canonical(as_json, manifest.base_dir) == manifest
    as_yaml = yaml.safe_load(resolved_yaml(manifest))
    assert manifest_from_canonical(as_yaml, manifest.base_dir) == manifest


def test_the_own_task_example_holds_out_its_eval_rows_and_scores_as_documented() -> None:
    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (OWN_TASK / name).read_text().splitlines()]

    train, held = rows("train.jsonl"), rows("eval.jsonl")
    manifest = load_manifest(OWN_TASK / "manifest.yaml")
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert manifest.task.eval_size == len(held)
    assert {r["answer"] for r in train} == {r["answer"] for r in held}
    spec = importlib.util.spec_from_file_location("own_task_reward", OWN_TASK / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [module.right_letter(c, "k", "") for c in ("kkkk", "k k a b", "abab", "")] == [
        1.0, 0.5, 0.0, 0.0
    ]  # fmt: skip
    assert module.one_letter(["zzzz", "zzab", ""], ["k"] * 3, [""] * 3) == [1.0, 0.5, 0.0]


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
