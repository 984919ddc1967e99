"""The scale benchmarks at a tiny shape on the CPU, under real torchrun with gloo: a member built
directly sharded (no rank ever holds the whole model, the same weights whatever the world
size), and a campaign of two sharded members side by side, checked end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, run_torchrun

pytestmark = pytest.mark.integration

BENCH = REPO / "bench"
TINY_RUN = ["--shape", "tiny", "--device", "cpu", "--seqs", "8", "--group", "4", "--micro", "4"]
TINY_RUN += ["--prompt", "8", "--completion", "8", "--steps", "1", "--warmup", "1"]


def _scale_run(out: Path, nproc: int) -> dict:
    run_torchrun(str(BENCH / "scale_run.py"), *TINY_RUN, "--figures", str(out), nproc=nproc)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _scale_run(tmp_path_factory.mktemp("scale") / "two.json", 2)


def test_sharded_build_trains_and_reports_finite_figures(two_ranks: dict):
    r = two_ranks
    assert r["world_size"] == 2 and r["shape"] == "tiny"
    for key in ("tok_s", "step_s", "loss", "gather_s", "save_s", "build_s"):
        assert math.isfinite(r[key]), key
    assert r["tok_s"] > 0 and r["tokens_per_step"] == 2 * 8 * 16
    assert r["trainable"] > 0 and r["checkpoint_gib"] > 0 and r["saved_gib"] > 0
    assert all(p > 0 for p in r["train_peak_gib"])
    # the checkpoint's state is the adapter with Adam's two moments, float32 (+ step counters)
    assert r["checkpoint_gib"] * 2**30 >= 3 * 4 * r["trainable"]


def test_no_rank_holds_more_than_its_share(two_ranks: dict):
    held, total = two_ranks["held_per_rank"], two_ranks["parameters"]
    assert sum(held) == total
    # uneven rows (a prime vocabulary) leave a rank at most one row per parameter over half
    assert max(held) <= total / 2 * 1.01, (held, total)


def test_weights_do_not_depend_on_the_world_size(two_ranks: dict, tmp_path: Path):
    one = _scale_run(tmp_path / "one.json", 1)
    assert one["parameters"] == two_ranks["parameters"] and one["held_per_rank"] == [
        one["parameters"]
    ]
    for a, b in zip(one["fingerprint"], two_ranks["fingerprint"], strict=True):
        assert a == pytest.approx(b, rel=1e-9)
    assert one["fingerprint"][1] > 0  # a non-trivial init: the sum of squares
    # the sharded forward computes with those weights, not with what to_empty left behind
    assert one["probe"] == pytest.approx(two_ranks["probe"], rel=1e-5) and one["probe"] > 0


def test_two_sharded_members_side_by_side_campaign(tmp_path: Path):
    out = tmp_path / "checks.json"
    cmd = [
        sys.executable, str(BENCH / "scale_campaign.py"), "--shape", "tiny",
        "--dir", str(tmp_path / "work"), "--gpus-per-member", "0", "--ranks", "2",
        "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    names = {c["check"] for c in checks}
    for generation in (0, 1):
        assert f"generation {generation}: members trained at once" in names
        assert f"generation {generation}: GPU sets disjoint" in names
        assert f"generation {generation}: 2 ranks per member" in names
    assert "mutation: a child's hyperparameters changed" in names
    assert "checkpoint loads on world size 1" in names
    assert "reloaded optimizer state equals the saved one" in names
    assert all(c["passed"] for c in checks), checks
