"""AgileRL's environment-backed ``environment:`` keys land on ``task.env``: a file's class
through ``entrypoint``, GEM's guessing game in each of AgileRL's three spellings, and one line
for each key that has no meaning here. (The published configs are fixtures run by
test_agilerl_config.py: ``pbt check`` and a 2 x 2 campaign each.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pbt.config import ConfigError, manifest_from_dict

GAME = "class Game:\n    max_turns = 3\n    def __init__(self, span=4):\n        self.span = span\n"


def _manifest(environment: dict, tmp_path: Path | None = None):
    data = {
        "algorithm": {"name": "GRPO", "batch_size": 2, "group_size": 2},
        "environment": environment,
    }
    return manifest_from_dict(data, base_dir=tmp_path)


def _problems(environment: dict, tmp_path: Path | None = None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        _manifest(environment, tmp_path)
    return err.value.problems


def test_a_files_class_becomes_task_env(tmp_path: Path) -> None:
    (tmp_path / "game.py").write_text(GAME)
    m = _manifest(
        {
            "env_type": "rollout",
            "entrypoint": "game.py:Game",
            "env_config": {"span": 8},
            "max_turns": 2,
            "strict_chat_template_boundary": True,
            "action_field": "message",
        },
        tmp_path,
    )
    env = m.task.env
    assert (env.file, env.class_, env.kwargs, env.max_turns) == ("game.py", "Game", {"span": 8}, 2)
    assert m.task.name is None and m.translation_notes == []


@pytest.mark.parametrize(
    "environment",
    [
        {"env_type": "multiturn", "env_name": "game:GuessTheNumber-v0-hard"},
        {"env_type": "rollout", "entrypoint": "gem:make",
         "env_config": {"env_id": "game:GuessTheNumber-v0-hard"}},
        {"env_type": "rollout", "factory": "gem:make", "entrypoint": "game:GuessTheNumber-v0-hard"},
    ],
    ids=["env_name", "entrypoint", "factory"],
)  # fmt: skip
def test_gems_guessing_game_is_the_builtin_game_in_each_spelling(environment: dict) -> None:
    m = _manifest(environment)
    env = m.task.env
    assert env.class_ == "builtin:guess_number"
    assert env.kwargs == {"low": 1, "high": 50, "max_turns": 7}  # GEM's -hard range and turns
    [note] = [n for n in m.translation_notes if "GuessTheNumber" in n]
    assert "played by builtin:guess_number over the same range (1 to 50) and turns (7)" in note


def test_gem_arguments_are_renamed_and_max_turns_kept() -> None:
    m = _manifest(
        {"env_name": "game:GuessTheNumber-v0-easy", "env_config": {"max_number": 20},
         "max_turns": 3}
    )  # fmt: skip
    assert m.task.env.kwargs == {"low": 1, "high": 20, "max_turns": 4}
    assert m.task.env.max_turns == 3


@pytest.mark.parametrize(
    ("environment", "start"),
    [
        ({"env_type": "rollout", "entrypoint": "mypkg.envs:Game"},
         "environment.entrypoint ('mypkg.envs:Game') is refused: task.env reads a class from a .py"),
        ({"env_type": "multiturn", "env_name": "game:Sudoku-v0-easy"},
         "environment.env_name ('game:Sudoku-v0-easy') is refused: GEM's environments are not"),
        ({"env_type": "rollout", "env_url": "http://localhost:8000", "max_turns": 3},
         "environment.env_url ('http://localhost:8000') is refused: environments run in the"),
        ({"entrypoint": "game.py:Game", "observation_field": "board"},
         "environment.observation_field ('board') is refused: an environment's reset()"),
        ({"entrypoint": "game.py:Game", "strict_chat_template_boundary": False},
         "environment.strict_chat_template_boundary (False) is refused"),
        ({"entrypoint": "game.py:Game", "action_field": "code"},
         "environment.action_field ('code') is refused"),
        ({"entrypoint": "game.py:Game", "chat_template_kwargs": {"enable_thinking": False}},
         "environment.chat_template_kwargs ({'enable_thinking': False}) is refused"),
        ({"env_type": "multiturn"}, "environment.env_type ('multiturn') names no environment"),
        ({"factory": "other:make", "entrypoint": "x"}, "environment.factory ('other:make') is"),
        ({"env_name": "game:GuessTheNumber-v0-easy", "env_config": {"secret": 3}},
         "environment.env_config.secret is not an argument of GEM's guess-the-number game"),
        ({"dataset": "rows.jsonl", "max_turns": 3},
         "environment.max_turns (3) is refused: rows are single-turn"),
        ({"dataset": "rows.jsonl", "env_config": {"span": 3}},
         "environment.env_config is refused: it is the keyword arguments of an"),
        ({"dataset": "rows.jsonl", "chat_template_kwargs": {"enable_thinking": False}},
         "environment.chat_template_kwargs ({'enable_thinking': False}) is refused"),
        ({"entrypoint": "mypkg:make", "max_turns": 3}, "environment.entrypoint ('mypkg:make') is"),
    ],
)  # fmt: skip
def test_keys_without_a_meaning_here_are_refused_in_one_line(
    environment: dict, start: str, tmp_path: Path
) -> None:
    (tmp_path / "game.py").write_text(GAME)
    (tmp_path / "rows.jsonl").write_text('{"question": "1 + 1", "answer": "2"}\n')
    if "dataset" in environment:
        environment |= _rows(tmp_path)
    problems = _problems(environment, tmp_path)
    assert len(problems) == 1 and problems[0].startswith(start), problems


def _rows(tmp_path: Path) -> dict:
    """A reward file for rows, and the keys that name it."""
    (tmp_path / "reward.py").write_text(
        "def reward_fn(completion, answer, question):\n    return 0.0\n"
    )
    return {"reward_file_path": "reward.py", "reward_fn_name": "reward_fn"}


def test_rows_take_agilerls_max_turns_of_one(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"question": "1 + 1", "answer": "2"}\n')
    m = _manifest({"dataset": "rows.jsonl", "max_turns": 1, **_rows(tmp_path)}, tmp_path)
    assert m.task.env is None and m.task.train == "rows.jsonl"


def test_env_packages_is_a_note(tmp_path: Path) -> None:
    (tmp_path / "game.py").write_text(GAME)
    m = _manifest({"entrypoint": "game.py:Game", "env_packages": {"pip": ["gem-llm"]}}, tmp_path)
    assert any(n.startswith("environment.env_packages ({'pip': ['gem-llm']}): nothing is")
               for n in m.translation_notes)  # fmt: skip


def test_a_single_agent_population_gets_a_tournament_of_one() -> None:
    m = manifest_from_dict(
        {"training": {"pop_size": 1}, "environment": {"env_name": "game:GuessTheNumber-v0-easy"}}
    )
    assert (m.population.size, m.population.tournament_size) == (1, 1)
