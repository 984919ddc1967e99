"""Rewards: weighted and batched terms, guarded calls with one-line errors, per-term metrics,
and reasoning-gym tasks scored by their own scorer."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import DRIVERS, small_manifest, small_sections, write_manifest

from pbt.algorithms.data.reasoning_gym import Scorer, extract_answer
from pbt.algorithms.data.rewards import Reward, RewardTerm, build_reward
from pbt.algorithms.data.tasks import Example, load_task
from pbt.algorithms.runtime.member import Member
from pbt.config import RewardRef, TaskConfig
from pbt.config.errors import ConfigError, RewardError
from pbt.protocol import faults
from pbt.worker.task import failed as _failed

CPU = torch.device("cpu")
REWARDS_PY = """
import math, time

def length(completion, answer, question):
    return len(completion)

def exact(completion, answer, question):
    return 1 if completion == answer else 0

def lengths(completions, answers, questions):
    return [float(len(c)) for c in completions]

def raises(completion, answer, question):
    return 1 / 0

def none(completion, answer, question):
    return None

def nan(completion, answer, question):
    return math.nan

def text(completion, answer, question):
    return "0.5"

def truth(completion, answer, question):
    return True

def short_batch(completions, answers, questions):
    return [1.0]

def hangs(completion, answer, question):
    time.sleep(60)

def times_out_itself(completion, answer, question):
    raise TimeoutError("my own deadline")
"""
ROWS = [Example("What is 2+3?", "5"), Example("Spell cat\nbackwards", "tac")]
COMPLETIONS = ["5", "the answer is tac, " + "clearly " * 20]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    return tmp_path


def _reward(folder: Path, *functions: str, timeout_s: float = 30.0, **ref) -> Reward:
    refs = [RewardRef(file="rewards.py", function=f, **ref) for f in functions]
    cfg = TaskConfig(rewards=refs, reward_timeout_s=timeout_s)
    return build_reward(cfg, folder, RewardTerm("unused", "unused", lambda *a: 0.0))


def test_the_total_is_the_weighted_sum_and_each_term_is_kept(folder):
    cfg = TaskConfig(
        rewards=[
            RewardRef(file="rewards.py", function="length", weight=0.5),
            RewardRef(file="rewards.py", function="exact", weight=-2.0),
        ]
    )
    total, parts = build_reward(cfg, folder, RewardTerm("own", "own", len))(ROWS, COMPLETIONS)
    assert parts["length"].tolist() == [1.0, float(len(COMPLETIONS[1]))]
    assert parts["exact"].tolist() == [1.0, 0.0]
    assert total.dtype == torch.float32
    assert total.tolist() == [0.5 - 2.0, 0.5 * len(COMPLETIONS[1])]


def test_the_tasks_own_reward_serves_unless_the_user_names_one(folder):
    own = RewardTerm("own", "builtin:x", lambda c, a, q: 7.0)
    total, parts = build_reward(TaskConfig(), folder, own)(ROWS, COMPLETIONS)
    assert total.tolist() == [7.0, 7.0] and list(parts) == ["own"]


def test_a_batched_reward_gets_lists_and_gives_one_number_each(folder):
    total, parts = _reward(folder, "lengths", batched=True)(ROWS, COMPLETIONS)
    assert total.tolist() == [1.0, float(len(COMPLETIONS[1]))] == parts["lengths"].tolist()


def test_two_functions_of_one_name_get_distinct_metric_names(folder):
    (folder / "other.py").write_text("def length(completion, answer, question):\n    return 1\n")
    refs = [
        RewardRef(file="rewards.py", function="length"),
        RewardRef(file="other.py", function="length"),
    ]
    reward = build_reward(TaskConfig(rewards=refs), folder, RewardTerm("x", "x", len))
    assert reward.names == ["rewards.length", "other.length"]


RUBRICS_PY = """
class Rubric:  # OpenEnv's shape: __call__ runs hooks around forward
    def __init__(self):
        self.calls = 0

    def __call__(self, action, observation):
        self.calls += 1
        return self.forward(action, observation)


class Exact(Rubric):
    def forward(self, action, observation):
        return 1.0 if action.message == observation.answer else 0.0


class Asks(Exact):
    def __init__(self, threshold):
        super().__init__()


class Later(Rubric):
    async def forward(self, action, observation):
        return 1.0


EXACT = Exact()
"""


@pytest.mark.parametrize("name", ["EXACT", "Exact"])
def test_a_rubric_instance_or_class_scores_like_a_reward_function(folder, name):
    (folder / "rubrics.py").write_text(RUBRICS_PY)
    refs = [RewardRef(file="rubrics.py", function=name)]
    assert refs[0].check_source(folder, "task.reward") == []  # a class is a name the file defines
    reward = build_reward(TaskConfig(rewards=refs), folder, None)
    total, _ = reward(ROWS, ["5", "tac"])
    assert total.tolist() == [1.0, 1.0] and reward.names == [name]


def test_rubrics_that_cannot_score_are_one_line(folder):
    (folder / "rubrics.py").write_text(RUBRICS_PY)

    def build(function: str, **ref) -> Reward:
        refs = [RewardRef(file="rubrics.py", function=function, **ref)]
        return build_reward(TaskConfig(rewards=refs), folder, None)

    with pytest.raises(ConfigError, match=r"'EXACT' is a rubric, which scores one completion"):
        build("EXACT", batched=True)
    with pytest.raises(ConfigError, match=r"\('Asks'\) is a rubric class that cannot be built"):
        build("Asks")
    with pytest.raises(RewardError, match=r"rubrics.py:Later raised TypeError: the rubric's fo"):
        build("Later")(ROWS, COMPLETIONS)


@pytest.mark.parametrize(
    ("function", "batched", "says"),
    [
        ("raises", False, "raised ZeroDivisionError: division by zero"),
        ("none", False, "returned None (NoneType)"),
        ("nan", False, "returned nan (float)"),
        ("text", False, "returned '0.5' (str)"),
        ("truth", False, "returned True (bool)"),
        ("times_out_itself", False, "raised TimeoutError: my own deadline"),
        ("short_batch", True, "returned 1 values for a batch of 2 completions"),
        ("none", True, "returned None (NoneType) for a batch of 2 completions"),
    ],
)
def test_a_faulty_reward_fails_with_one_line_naming_function_row_and_value(
    folder, function, batched, says
):
    with pytest.raises(RewardError) as err:
        _reward(folder, function, batched=batched)(ROWS, COMPLETIONS)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"reward rewards.py:{function}")
    assert says in message
    if function != "short_batch" and not (batched and function == "none"):
        assert "'What is 2+3?'" in message and "completion '5'" in message


def test_the_row_is_quoted_on_one_line_with_an_excerpt_of_the_completion(folder):
    with pytest.raises(RewardError) as err:
        _reward(folder, "none")(ROWS[1:], COMPLETIONS[1:])
    message = str(err.value)
    assert "\n" not in message and "'Spell cat\\nbackwards'" in message
    assert "completion 'the answer is tac, clearly" in message
    assert COMPLETIONS[1] not in message and "...'" in message


def test_a_hung_reward_fails_after_the_timeout(folder):
    reward = _reward(folder, "hangs", timeout_s=1.0)
    started = time.perf_counter()
    with pytest.raises(RewardError, match=r"took longer than task.reward_timeout_s \(1 s\)"):
        reward(ROWS, COMPLETIONS)
    assert 0.9 < time.perf_counter() - started < 2.0


def test_a_reward_error_is_a_reported_fault(tmp_path, capsys):
    err = RewardError("reward rewards.py:none returned None (NoneType) on ...")
    assert faults.classify(err) == "reward_error"
    assert _failed(tmp_path, err)
    assert faults.read(tmp_path) == ("reward_error", f"RewardError: {err}")
    assert capsys.readouterr().err == f"error: {err}\n"  # its message, no traceback


def test_a_missing_rewards_entry_names_its_key(folder):
    refs = [
        RewardRef(file="rewards.py", function="length"),
        RewardRef(file="nope.py", function="f"),
    ]
    with pytest.raises(ConfigError, match=r"task.rewards\[1\].file \('nope.py'\) not found"):
        build_reward(TaskConfig(rewards=refs), folder, RewardTerm("x", "x", len))


# -- reasoning-gym -----------------------------------------------------------------------------


def test_the_answer_is_the_last_answer_tag_else_the_last_line():
    assert extract_answer("think\n<answer> 4 </answer> or <answer>-4</answer>\n") == "-4"
    assert extract_answer("first 3\n\n  so: 7  \n\n") == "so: 7"
    assert extract_answer("") == ""


def test_reasoning_gym_rows_are_disjoint_and_scored_by_the_datasets_scorer():
    cfg = TaskConfig(name="reasoning_gym:basic_arithmetic", train_size=24, eval_size=6)
    task = load_task(cfg, ".", seed=3)
    assert len(task.eval) == 6 and 0 < len(task.train) <= 24
    assert not {ex.question for ex in task.eval} & {ex.question for ex in task.train}
    assert task.reward.names == ["basic_arithmetic"]
    row = task.eval[0]
    right = f"Let me compute.\n<answer>{row.answer['answer']}</answer>"
    total, _ = task.reward([row, row], [right, "<answer>not a number</answer>"])
    assert total.tolist() == [1.0, 0.0]
    assert load_task(cfg, ".", seed=3).eval == task.eval  # the same rows for a seed


@pytest.mark.parametrize(
    ("name", "options", "says"),
    [
        ("basic_arithmetic_x", {}, "did you mean reasoning_gym:basic_arithmetic"),
        ("basic_arithmetic", {"bogus": 1}, "its options are min_terms, max_terms"),
        ("basic_arithmetic", {"min_terms": 0}, "min_terms must be positive"),
        ("basic_arithmetic", {"seed": 1}, "task.options.seed (1) is set by training.seed"),
    ],
)
def test_reasoning_gym_refuses_bad_names_and_options_in_one_line(name, options, says):
    cfg = TaskConfig(name=f"reasoning_gym:{name}", options=options, train_size=4, eval_size=2)
    with pytest.raises(ConfigError) as err:
        load_task(cfg, ".", seed=0)
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0]
    assert says in err.value.problems[0]


def test_a_member_trains_on_reasoning_gym_with_the_scorer_as_its_reward(tmp_path):
    task = {"name": "reasoning_gym:leg_counting", "train_size": 16, "eval_size": 4}
    member = Member(small_manifest(tmp_path, task=task), CPU)
    history = member.train(2)
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["reward/leg_counting"] == h["reward_mean"] for h in history)
    examples = member.learner.sample_prompts(member.task.train)
    batch = member.learner.complete([ex.question for ex in examples])
    scored = member.learner.score(examples, batch, member.task.reward)
    scorer = Scorer(member.task.reward.terms[0].fn.dataset)
    group = member.manifest.algorithm.group_size
    expected = [
        scorer.dataset.score_answer(extract_answer(t), examples[i // group].answer)
        for i, t in enumerate(batch.texts)
    ]
    assert scored.tolist() == pytest.approx(expected)
    assert 0.0 <= member.learner.evaluate(member.task.eval, member.task.reward) <= 1.0


def test_each_reward_terms_mean_is_a_step_metric(folder):
    rewards = [
        {"file": "rewards.py", "function": "length", "weight": 0.25},
        {"file": "rewards.py", "function": "exact", "weight": 2.0},
    ]
    member = Member(small_manifest(folder, task={"rewards": rewards}), CPU)
    (step,) = member.train(1)
    assert step["reward/length"] > 0 and step["reward/exact"] == 0.0
    assert step["reward_mean"] == pytest.approx(0.25 * step["reward/length"], rel=1e-5)


@pytest.mark.integration
def test_pbt_train_stops_on_a_reward_that_returns_none_with_one_line(folder):
    manifest = write_manifest(
        folder / "m.yaml",
        small_sections(folder),
        task={"reward": {"file": "rewards.py", "function": "none"}},
        training={"steps": 1},
    )
    done = subprocess.run(
        [sys.executable, "-m", "pbt.cli", "train", str(manifest)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # One error line. Other stderr lines (a library's warning on some machine) are not the
    # message under test; they are shown if the assertion fails.
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    (line,) = errors
    assert line.startswith("error: reward rewards.py:none returned None (NoneType) for question")


# -- an error the same input reproduces ------------------------------------------------------


FLAKY_PY = """
calls = []

def flaky(completion, answer, question):
    calls.append(completion)
    if len(calls) == 1:
        raise ConnectionError("the judge is busy")
    return 0.5
"""


def test_a_failed_call_is_made_once_more_and_a_second_failure_is_reproduced(folder):
    (folder / "flaky.py").write_text(FLAKY_PY)
    flaky = build_reward(
        TaskConfig(reward=RewardRef(file="flaky.py", function="flaky")), folder, None
    )
    total, _ = flaky(ROWS[:1], COMPLETIONS[:1])  # the second call's value counts
    assert total.tolist() == [0.5] and flaky.terms[0].fn.__globals__["calls"] == ["5", "5"]
    with pytest.raises(RewardError) as err:
        _reward(folder, "none")(ROWS, COMPLETIONS)
    assert err.value.reproduced and faults.classify(err.value) == "reward_error"
    assert "reward_error" in faults.NOT_RETRIED and "config_error" in faults.NOT_RETRIED


def test_a_timeout_is_not_repeated_and_is_retried_by_a_campaign(folder):
    started = time.perf_counter()
    with pytest.raises(RewardError) as err:
        _reward(folder, "hangs", timeout_s=0.5)(ROWS[:1], COMPLETIONS[:1])
    assert time.perf_counter() - started < 1.4  # waited once, not twice
    assert not err.value.reproduced and faults.classify(err.value) is None


@pytest.mark.integration
def test_a_campaign_replaces_a_member_whose_reward_returns_none_without_retrying(folder):
    """g000-m01 scores a row with the manifest's reward (the real Reward, in the fake member):
    it returns None, twice on the same input; the member fails once, is replaced by a clone at
    once, and the campaign finishes."""
    import json

    from pbt.controller.campaign import Campaign
    from pbt.controller.store import CampaignStore

    fake = [sys.executable, str(DRIVERS / "fake_member.py")]
    manifest = write_manifest(
        folder / "m.yaml",
        {
            "task": {
                "name": "builtin:letters",
                "reward": {"file": "rewards.py", "function": "none"},
            },
            "population": {"size": 3, "evo_steps": 2},
            "budget": {"generations": 2},
            "launch": {"slots": 3, "max_attempts": 3, "persistent_workers": False},
            "tracking": {"enabled": False},
        },
    )
    directory = folder / "c"
    campaign = Campaign.start(manifest, directory, member_command=fake)
    (directory / "faults.json").write_text(json.dumps({"g000-m01": ["reward"]}))
    said: list[str] = []
    campaign.say = said.append
    started = time.perf_counter()
    try:
        summary = campaign.run()
    finally:
        campaign.close()
    elapsed = time.perf_counter() - started
    logs = sorted(p.name for p in (directory / "logs").glob("g000-m01.*"))
    assert logs == ["g000-m01.attempt1.log"], (logs, said)  # one attempt of three
    with CampaignStore(directory / "store.db") as store:
        kinds = [(f["member_id"], f["kind"]) for f in store.faults()]
        member = next(m for m in store.members() if m.member_id == "g000-m01")
    assert ("g000-m01", "reward_error") in kinds and ("g000-m01", "replaced") in kinds, kinds
    assert member.mutation.startswith("replaced by a clone of"), member.mutation
    line = next(s for s in said if "g000-m01 reward_error" in s)
    assert "rewards.py:none returned None (NoneType)" in line and "replacing" in line, said
    assert summary.generations == 2 and elapsed < 60, (summary, elapsed)
