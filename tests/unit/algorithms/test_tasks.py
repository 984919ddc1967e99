"""Built-in tasks and user reward functions."""

from __future__ import annotations

import pytest

from pbt.algorithms.data.tasks import Example, arithmetic_reward, letters_reward, load_task
from pbt.config import RewardRef, TaskConfig
from pbt.config.errors import ConfigError


def test_letters_reward_gives_partial_credit():
    assert letters_reward("qqqq", "q", "") == 1.0
    assert letters_reward("aaaa", "q", "") == 0.5
    assert letters_reward("qq ab", "q", "") == pytest.approx(0.5 * (2 + 2) / 4)
    assert letters_reward("   ", "q", "") == 0.0
    assert letters_reward("QQ", "q", "") == 1.0


def test_arithmetic_reward_judges_the_last_number():
    assert arithmetic_reward("3 + 5 = 8", "8", "") == 1.0
    assert arithmetic_reward("it is 8, no 9", "8", "") == 0.0
    assert arithmetic_reward("no idea", "8", "") == 0.0


@pytest.mark.parametrize("name", ["builtin:letters", "builtin:arithmetic"])
def test_splits_are_disjoint_and_deterministic(name):
    cfg = TaskConfig(name=name, train_size=200, eval_size=40)
    task = load_task(cfg, ".", seed=3)
    again = load_task(cfg, ".", seed=3)
    assert task.train == again.train and task.eval == again.eval
    assert len(task.eval) == 40
    assert not {e.question for e in task.train} & {e.question for e in task.eval}
    other = load_task(cfg, ".", seed=4)
    assert other.eval != task.eval


def test_user_reward_is_loaded_from_the_named_file(tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def short(completion, answer, question):\n    return 1.0 / (1 + len(completion))\n"
    )
    cfg = TaskConfig(reward=RewardRef(file="rewards.py", function="short"))
    task = load_task(cfg, tmp_path, seed=0)
    total, parts = task.reward([Example("", None)], ["abc"])
    assert total.tolist() == [0.25] and parts["short"].tolist() == [0.25]


@pytest.mark.parametrize(
    ("source", "function", "message"),
    [
        (None, "f", "not found"),
        ("def f(completion):\n    return 0.0\n", "f", "take (completion, answer, question) by"),
        (
            "def g(c, a, q):\n    return 0.0\n",
            "f",
            "is not defined in rewards.py; its functions: ['g']",
        ),
        ("raise RuntimeError('boom')\n", "f", "failed to import"),
    ],
)
def test_bad_user_rewards_are_clear_errors(tmp_path, source, function, message):
    if source is not None:
        (tmp_path / "rewards.py").write_text(source)
    cfg = TaskConfig(reward=RewardRef(file="rewards.py", function=function))
    with pytest.raises(
        ConfigError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        load_task(cfg, tmp_path, seed=0)


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ConfigError, match="not a known task"):
        load_task(TaskConfig(name="builtin:chess"), ".", seed=0)
