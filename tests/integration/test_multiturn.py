"""A user's multi-turn environment everywhere members run: ``pbt check``, ``pbt train``, a
2 x 2 campaign with a resume, library mode's ``finetune_llm_multiturn``, and a member of two
ranks under torchrun; a failing environment stops ``pbt train`` with one line."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import DRIVERS, REPO, needs_vllm, run_torchrun, small_sections, vllm_env

from pbt.config.errors import ConfigError
from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore

EXAMPLE = REPO / "configs" / "examples" / "multiturn"
pytestmark = pytest.mark.integration


def _pbt(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pbt.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _example(tmp_path: Path, **changes: dict) -> Path:
    """The example folder copied, its manifest shrunk for a CPU test and changed by section."""
    folder = Path(shutil.copytree(EXAMPLE, tmp_path / "example"))
    data = yaml.safe_load((folder / "manifest.yaml").read_text())
    data["training"] |= {"steps": 2, "device": "cpu", "output_dir": str(tmp_path / "out")}
    data["task"] |= {"eval_size": 4}
    data["population"] |= {"evo_steps": 1}
    data["budget"] = {"generations": 1}
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    (folder / "manifest.yaml").write_text(yaml.safe_dump(data))
    return folder / "manifest.yaml"


def test_pbt_check_and_train_run_an_environment_from_the_users_file(tmp_path):
    manifest = _example(tmp_path)
    check = _pbt("check", str(manifest))
    assert check.returncode == 0 and "valid" in check.stderr, check.stderr
    train = _pbt("train", str(manifest))
    assert train.returncode == 0, train.stderr
    assert "task LetterGame" in train.stdout and "done: held-out reward" in train.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    steps = [r for r in rows if "reward/turns" in r]
    assert len(steps) == 2 and all(1 <= r["reward/turns"] <= 4 for r in steps)
    assert (tmp_path / "out" / "checkpoint" / "attributes.pt").exists()


def test_pbt_train_stops_on_a_raising_environment_with_one_line(tmp_path):
    manifest = _example(tmp_path)
    game = manifest.parent / "letter_game.py"
    game.write_text(game.read_text().replace("guess = next(", "guess = 1 / 0 or next("))
    train = _pbt("train", str(manifest))
    assert train.returncode == 2
    [line] = [line for line in train.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: environment LetterGame (letter_game.py): step() at turn 1")
    assert "raised ZeroDivisionError: division by zero; fix step()" in line
    assert "Traceback" not in train.stderr
    bad = _pbt("check", str(manifest))
    assert bad.returncode == 2 and "raised ZeroDivisionError" in bad.stderr


def test_a_two_by_two_campaign_resumes(tmp_path):
    manifest = _example(tmp_path, launch={"persistent_workers": False})
    directory = tmp_path / "campaign"
    first = Campaign.start(manifest, directory)
    first.say = lambda *_: None
    try:
        assert first.run().generations == 1
    finally:
        first.close()
    resumed = Campaign.resume(directory, budget={"generations": 2})
    resumed.say = lambda *_: None
    try:
        summary = resumed.run()
    finally:
        resumed.close()
    assert summary.generations == 2
    with CampaignStore(directory / "store.db") as store:
        members = store.members()
    assert len(members) == 4
    assert all(m.fitness_history for m in members)


def test_finetune_llm_multiturn_takes_agilerls_call_shape(tmp_path, monkeypatch):
    from pbt.agilerl.finetune import finetune_llm_multiturn
    from pbt.library.create import create_population

    monkeypatch.syspath_prepend(str(EXAMPLE))
    game = importlib.import_module("letter_game")  # as a user's script imports its file
    config = small_sections(tmp_path, task={"eval_size": 4, "name": None})
    pop = create_population(config=config, population_size=2)
    with pytest.raises(ConfigError, match=r"top level of a \.py file"):
        finetune_llm_multiturn(pop, 3, lambda: game.LetterGame())
    pop, fitnesses = finetune_llm_multiturn(
        pop, max_turns=3, env_factory=game.LetterGame, env_config={"span": 4},
        evo_steps=1, steps=2, tracking=False, verbose=False,
    )  # fmt: skip
    assert len(fitnesses) == 2 and all(0.0 <= f <= 1.0 for f in fitnesses)
    env = pop.manifest.task.env
    assert (env.class_, env.kwargs, env.max_turns) == ("LetterGame", {"span": 4}, 3)


def test_two_ranks_play_their_own_episodes_and_keep_one_adapter(tmp_path):
    """``torchrun --nproc_per_node=2`` (gloo): each rank plays ``group_size`` episodes from
    each of its own training seeds (the environment logs every reset by rank), the gradients
    are averaged (both ranks end with the same, changed adapter), and the checkpoint is
    written once."""
    run_torchrun(str(DRIVERS / "multiturn_ranks_driver.py"), str(tmp_path), "hf", timeout=300)
    _two_ranks_played_and_agree(tmp_path)


@needs_vllm
def test_two_ranks_play_their_episodes_through_one_spanning_vllm_engine(tmp_path, monkeypatch):
    """The same with one vLLM engine over both ranks (``tensor_parallel_size: 2``): each rank
    submits both ranks' token prompts every turn and keeps its own replies."""
    for key, value in vllm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    run_torchrun(str(DRIVERS / "multiturn_ranks_driver.py"), str(tmp_path), "vllm-tp2")
    _two_ranks_played_and_agree(tmp_path)


def _two_ranks_played_and_agree(tmp_path: Path) -> None:
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    train, held_out = set(ranks[0]["train_seeds"]), set(ranks[0]["eval_seeds"])
    played = []
    for r in (0, 1):
        resets = [int(s) for s in (tmp_path / f"resets-rank{r}.txt").read_text().split()]
        seeds = [s for s in resets if s in train]
        assert len(seeds) == 2 * 2 * 4  # 2 steps x 2 seeds (this rank's half of 4) x group 4
        assert all(seeds.count(s) == 4 for s in seeds)
        assert {s for s in resets if s not in train} <= held_out
        played.append(set(seeds))
    assert not played[0] & played[1]  # different rows on each rank
    assert ranks[0]["after"] == ranks[1]["after"] != ranks[0]["before"]
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[0]["fitness"] == ranks[1]["fitness"]
    assert ranks[0]["digest"] and ranks[1]["digest"] is None  # rank 0 wrote the checkpoint
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]
