"""A curriculum (``task.stages``): the manifest rules, and real runs on the tiny model: the stage
switches at its step, a copy goes on in its parent's stage and place, and a resumed member
trains exactly as one that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from support import small_manifest

from pbt.algorithms.data.stages import StagedRows
from pbt.algorithms.runtime.checkpoint import load_checkpoint
from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError
from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore

CPU = torch.device("cpu")
REWARD = (
    "def exact(completion, answer, question):\n    return float(completion.strip() == answer)\n"
)


def _files(tmp_path: Path) -> dict:
    """Two stages of distinct rows (``a``: single letters, ``b``: pairs) and their reward."""
    for name, size in (("a", 1), ("b", 2)):
        rows = [
            {"question": f"{name} repeat {i}", "answer": chr(97 + i % 26) * size} for i in range(40)
        ]
        held = [{"question": f"{name} held {i}", "answer": "x" * size} for i in range(8)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        (tmp_path / f"{name}_eval.jsonl").write_text("\n".join(json.dumps(r) for r in held))
    (tmp_path / "reward.py").write_text(REWARD)
    return {
        "stages": [
            {"until_step": 2, "train": "a.jsonl", "eval": "a_eval.jsonl"},
            {"train": "b.jsonl", "eval": "b_eval.jsonl"},
        ],
        "replay": 0.5,
        "reward": {"file": "reward.py", "function": "exact"},
        "name": None,
        "eval_size": 8,
    }


def _manifest(tmp_path: Path):
    return small_manifest(tmp_path, task=_files(tmp_path), training={"steps": 6})


def _step(member: Member) -> tuple[float, dict]:
    reward = member.learner.train_step(member.task.train, member.task.reward)["reward_mean"]
    return reward, member.learner.data.state_dict()


def _adapter(member: Member) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in member.model.named_parameters() if p.requires_grad}


def test_rows_of_each_stage_and_the_stage_of_each_step() -> None:
    rows = StagedRows([["a0", "a1", "a2"], ["b0", "b1"]], [4, None], 0.2)
    assert len(rows) == 5 and rows[2] == "a2" and rows[3] == "b0" and rows[-1] == "b1"
    assert rows[1:4] == ["a1", "a2", "b0"]
    assert [rows.stage_at(s) for s in (0, 3, 4, 99)] == [0, 0, 1, 1]


@pytest.mark.integration
def test_the_stage_switches_at_its_step_and_replays_earlier_rows(tmp_path) -> None:
    member = Member(_manifest(tmp_path), CPU)
    task = member.task
    assert isinstance(task.train, StagedRows) and task.train.offsets == [0, 40, 80]
    assert len(task.eval) == 16  # eval_size of each stage, together
    seen = []
    original = member.learner.data.take_staged

    def recording(train, step, count):
        order = original(train, step, count)
        seen.append((step, [train[i].question.split()[0] for i in order]))
        return order

    member.learner.data.take_staged = recording
    states = [_step(member)[1] for _ in range(6)]
    assert [state["stage"] for state in states] == [0, 0, 1, 1, 1, 1]
    assert states[1]["stages"] == [[0, 4]]  # two steps of two prompts from stage a
    assert [s for s, _ in seen] == list(range(6))
    assert all(names == ["a", "a"] for _, names in seen[:2])
    later = [n for _, names in seen[2:] for n in names]
    assert "b" in later and "a" in later  # stage b, with half the prompts replayed from a
    fresh_b = later.count("b")
    assert states[-1]["stages"] == [[0, 4], [0, fresh_b]]


@pytest.mark.integration
def test_a_copy_goes_on_in_its_parents_stage_and_a_resume_equals_a_straight_run(tmp_path):
    manifest = _manifest(tmp_path)
    straight = Member(manifest, CPU)
    straight_steps = [_step(straight) for _ in range(5)]

    parent = Member(manifest, CPU)
    parent_steps = [_step(parent) for _ in range(3)]
    parent.save(tmp_path / "ckpt")
    copy = Member(manifest, CPU)  # a copied member, or the same member resumed
    copy.load(tmp_path / "ckpt")
    assert copy.learner.data.state_dict() == parent_steps[-1][1]
    assert copy.learner.data.state_dict()["stage"] == 1
    copy_steps = [_step(copy) for _ in range(2)]

    assert parent_steps + copy_steps == straight_steps
    a, b = _adapter(straight), _adapter(copy)
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize(
    ("task", "words"),
    [
        ({"name": "builtin:letters"}, "task.stages replaces task.name and task.train"),
        (
            {"stages": [{"until_step": 4, "name": "builtin:letters"}, {"name": "builtin:letters"}]},
            None,
        ),
        (
            {"stages": [{"name": "builtin:letters"}, {"name": "builtin:letters"}]},
            "task.stages until_step ([None, None]) must rise",
        ),
        (
            {"stages": [{"until_step": 4, "name": "builtin:letters"}, {"train": "b.jsonl"}]},
            "task.stages take their rows from 2 sources",
        ),
        (
            {"stages": [{"until_step": 4, "name": "builtin:letters"}], "replay": 1.0},
            "task.replay (1.0) must be in [0, 1)",
        ),
        (
            {"stages": [{"until_step": 4, "name": "builtin:letters", "train": "a.jsonl"}]},
            "task.stages[0] must name its rows with exactly one of name",
        ),
    ],
)
def test_bad_stages_are_one_line_each(tmp_path, task, words) -> None:
    stages = {"name": None, **task} if "stages" in task else {"stages": [{"name": "x"}], **task}
    if words is None:
        small_manifest(tmp_path, task=stages)
        return
    with pytest.raises(ConfigError) as caught:
        small_manifest(tmp_path, task=stages)
    assert any(p.startswith(words) for p in caught.value.problems), caught.value.problems


def test_replay_needs_stages(tmp_path) -> None:
    with pytest.raises(ConfigError) as caught:
        small_manifest(tmp_path, task={"replay": 0.2})
    assert caught.value.problems[0].startswith("task.replay (0.2) replays earlier stages")


@pytest.mark.integration
def test_a_campaigns_copies_read_on_in_their_parents_stage(tmp_path) -> None:
    """A 2 x 2 campaign of real members (the worker, the tiny model): generation 1's members
    start from their parents' checkpoints at step 2 and cross into stage b at step 3; their
    stage-a position holds all three stage-a steps, two of them their parent's."""
    sections = {
        "model": {"name": "builtin:tiny"},
        "algorithm": {"group_size": 2, "prompts_per_step": 2},
        "rollout": {"max_output_tokens": 4},
        "task": _files(tmp_path) | {"stages": [
            {"until_step": 3, "train": "a.jsonl", "eval": "a_eval.jsonl"},
            {"train": "b.jsonl", "eval": "b_eval.jsonl"},
        ]},
        "training": {"seed": 2, "device": "cpu"},
        "population": {"size": 2, "tournament_size": 2, "evo_steps": 2},
        "budget": {"generations": 2},
        "launch": {"slots": 2, "persistent_workers": False},
        "tracking": {"enabled": False},
    }  # fmt: skip
    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump(sections))
    campaign = Campaign.start(path, tmp_path / "run")
    campaign.say = lambda *_: None
    try:
        campaign.run()
    finally:
        campaign.close()
    with CampaignStore(tmp_path / "run" / "store.db") as store:
        members = store.members()
    positions = {
        m.member_id: load_checkpoint(tmp_path / "run" / m.checkpoint)["learner"]["data"]
        for m in members
    }
    for m in members:
        data = positions[m.member_id]
        if m.generation == 0:
            assert data["stage"] == 0 and data["stages"] == [[0, 4]]
        else:
            assert m.parent_id is not None and m.steps == 4
            assert data["stage"] == 1 and data["stages"][0] == [0, 6]
            assert positions[m.parent_id]["stages"][0] == [0, 4]


def test_pbt_check_reads_each_stages_files(tmp_path, capsys) -> None:
    from pbt.cli.main import main

    task = _files(tmp_path)
    task.pop("name")
    sections = {
        "model": {"name": "builtin:tiny"},
        "task": task,
        "training": {"device": "cpu"},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(sections))
    assert main(["check", str(path)]) == 0
    task["stages"][1]["train"] = "missing.jsonl"
    path.write_text(yaml.safe_dump(sections))
    assert main(["check", str(path)]) == 2
    assert "task.stages[1].train ('missing.jsonl') not found" in capsys.readouterr().err
