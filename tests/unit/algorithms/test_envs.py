"""Multi-turn environments on the tiny model: token-in/token-out trajectories, masks, tools,
truncation, returns grouped by seed, and one-line errors for environments that fail."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import torch
from support import small_manifest

from pbt.algorithms.envs.builtin import CalculatorEnv, GuessNumberEnv, RunningSumEnv, calculator
from pbt.algorithms.envs.episodes import play, play_batch, to_batch
from pbt.algorithms.envs.task import check_env, episode_seeds, episodes_for
from pbt.algorithms.rollout.hf import sequence_logprobs
from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError, EnvError
from pbt.config.read.loader import manifest_from_dict
from pbt.protocol.faults import classify

CPU = torch.device("cpu")

BAD_ENVS = """
import time

class Base:
    max_turns = 3
    def reset(self, seed=None):
        return "Say something.", {}
    def step(self, action):
        return "Again.", 0.0, False, False, {}

class Raises(Base):
    def step(self, action):
        raise KeyError("no such move")

class Hangs(Base):
    def step(self, action):
        time.sleep(30)

class BadReward(Base):
    def step(self, action):
        return "Again.", "1.0", False, False, {}

class NoMaxTurns:
    def reset(self, seed=None):
        return "hi", {}
    def step(self, action):
        return "", 1.0, True, False, {}
"""


@pytest.fixture(scope="module")
def member(tmp_path_factory) -> Member:
    tmp = tmp_path_factory.mktemp("envs")
    manifest = small_manifest(
        tmp, task={"env": {"class": "builtin:guess_number"}, "eval_size": 4, "name": None}
    )
    return Member(manifest, CPU)


def _episodes(member: Member, tmp_path: Path, cls: str, timeout_s: float = 30.0, **env):
    (tmp_path / "envs.py").write_text(BAD_ENVS)
    manifest = manifest_from_dict(
        {"task": {"env": {"file": "envs.py", "class": cls, **env}, "env_timeout_s": timeout_s}},
        base_dir=tmp_path,
    )
    return episodes_for(manifest.task, tmp_path)


def _scripted(replies: list[list[int]]):
    """A sampler that returns ``replies`` in turn, to every live episode (the model stands in
    for nothing else: tokenizer, template, environment and batch are the real ones)."""
    calls = iter(replies)

    def sample(contexts: list[list[int]], max_new: int) -> list[list[int]]:
        reply = next(calls)
        return [reply[:max_new] for _ in contexts]

    return sample


def _wrong_guess(seed: int) -> str:
    env = GuessNumberEnv()
    env.reset(seed)
    return "1" if env.secret != 1 else "2"


def _resegmented_word(tokenizer) -> tuple[str, list[int]]:
    """A word and ids that decode to it but are not what encoding it gives (one id per
    character where the tokenizer merges them)."""
    for word in ("the", "and", "number", "apples", "hello"):
        merged = tokenizer(word, add_special_tokens=False)["input_ids"]
        split = [tokenizer.convert_tokens_to_ids(c) for c in word]
        if tokenizer.unk_token_id not in split and len(merged) < len(split):
            return word, split
    raise AssertionError("no word the tiny tokenizer merges")


# -- token-in/token-out ----------------------------------------------------------------------


def test_sampled_ids_are_kept_where_retokenizing_would_change_them(member):
    tok, eos = member.tokenizer, member.tokenizer.eos_token_id
    word, split = _resegmented_word(tok)
    assert tok.decode(split) == word
    assert tok(tok.decode(split), add_special_tokens=False)["input_ids"] != split  # BPE re-merges
    episodes = dataclasses.replace(member.task.reward, max_turns=2)
    [trajectory] = play(member.learner, episodes, [7], sampler=_scripted([[*split, eos]] * 2))
    first = trajectory.ids[: len(split) + 1]
    assert first == [*split, eos]
    assert trajectory.sampled[: len(split) + 1] == [True] * (len(split) + 1)
    batch = to_batch([trajectory], tok, CPU)
    assert batch.completion_ids[0, : len(split) + 1].tolist() == [*split, eos]


def test_each_observation_is_appended_within_the_templates_turn_boundaries(member):
    tok, eos = member.tokenizer, member.tokenizer.eos_token_id
    guess = _wrong_guess(3)
    reply = tok(guess, add_special_tokens=False)["input_ids"] + [eos]
    episodes = dataclasses.replace(member.task.reward, max_turns=2)
    [trajectory] = play(member.learner, episodes, [3], sampler=_scripted([reply, reply]))
    env = GuessNumberEnv()
    first, _ = env.reset(3)
    feedback = env.step(guess)[0]
    conversation = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": guess},
        {"role": "user", "content": feedback},
        {"role": "assistant", "content": guess},
    ]
    whole = tok.apply_chat_template(conversation, tokenize=False)
    expected = tok(whole, add_special_tokens=False)["input_ids"]
    # the template closes the last turn with "<|im_end|>\n": the trajectory ends at the EOS
    assert trajectory.context == expected[: len(trajectory.context)]
    assert len(trajectory.context) == len(expected) - 1
    observation = [i for i, s in zip(trajectory.ids, trajectory.sampled, strict=True) if not s]
    assert feedback in tok.decode(observation)


def test_observation_tokens_are_attended_to_but_masked_out_of_the_loss(member):
    tok, eos = member.tokenizer, member.tokenizer.eos_token_id
    reply = tok(_wrong_guess(11), add_special_tokens=False)["input_ids"] + [eos]
    episodes = dataclasses.replace(member.task.reward, max_turns=2)
    [trajectory] = play(member.learner, episodes, [11], sampler=_scripted([reply, reply]))
    batch = to_batch([trajectory], tok, CPU)
    loss, attention = batch.completion_mask[0], batch.attention[0]
    n = len(trajectory.ids)
    assert loss[:n].tolist() == [float(s) for s in trajectory.sampled]
    assert attention[:n].sum() == n and 0 < loss.sum() < n
    # the second reply's log-probs depend on the observation before it: it is attended to
    observation_at = trajectory.sampled.index(False)
    changed = batch.select(torch.tensor([0]))
    changed.completion_ids = changed.completion_ids.clone()
    changed.completion_ids[0, observation_at + 2] = tok.convert_tokens_to_ids("z")
    with torch.no_grad():
        a = sequence_logprobs(member.model, batch, 1.0)[0, -len(reply) :]
        b = sequence_logprobs(member.model, changed, 1.0)[0, -len(reply) :]
    assert not torch.allclose(a, b)


def test_a_reply_cut_by_the_turn_cap_gets_a_masked_eos_and_the_budget_truncates(member):
    tok, eos = member.tokenizer, member.tokenizer.eos_token_id
    text = "one two three four five six seven eight nine ten"
    long_reply = tok(text, add_special_tokens=False)["input_ids"]
    episodes = dataclasses.replace(member.task.reward, max_turns=6, max_episode_tokens=30)
    [trajectory] = play(member.learner, episodes, [5], sampler=_scripted([long_reply] * 6))
    cap = member.learner.rollout_cfg.max_output_tokens
    assert trajectory.ids[:cap] == long_reply[:cap] and trajectory.ids[cap] == eos
    assert trajectory.sampled[cap] is False
    assert trajectory.truncated and len(trajectory.ids) <= 30
    assert trajectory.turns < 6


# -- tools, returns, groups -------------------------------------------------------------------


def test_a_tool_call_returns_its_result_as_an_observation(member):
    tok, eos = member.tokenizer, member.tokenizer.eos_token_id
    env = CalculatorEnv()
    question, _ = env.reset(4)
    expression = question.removeprefix("What is ").removesuffix("?")
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
    answer = calculator(expression)
    replies = [tok(text, add_special_tokens=False)["input_ids"] + [eos] for text in (call, answer)]
    manifest = manifest_from_dict({"task": {"env": {"class": "builtin:calculator"}}})
    episodes = dataclasses.replace(episodes_for(manifest.task, "."), max_episode_tokens=4096)
    big = dataclasses.replace(member.learner.rollout_cfg, max_output_tokens=200)
    member.learner.rollout_cfg, saved = big, member.learner.rollout_cfg
    try:
        [played] = play(member.learner, episodes, [4], sampler=_scripted(replies))
    finally:
        member.learner.rollout_cfg = saved
    assert played.tool_calls == 1 and played.turns == 2
    assert played.rewards == [0.0, 1.0] and played.success
    observed = tok.decode([i for i, s in zip(played.ids, played.sampled, strict=True) if not s])
    assert answer in observed and "tool" in observed
    assert "calculator" in tok.decode(played.prompt)  # the tools are offered in the system turn
    bare = dataclasses.replace(episodes, use_tools=False)  # the same episode without the tool
    [unaided] = play(member.learner, bare, [4], sampler=_scripted(replies))
    assert unaided.tool_calls == 0 and unaided.turns == 1 and unaided.rewards == [0.0]
    assert "calculator" not in tok.decode(unaided.prompt)


def test_returns_sum_per_turn_rewards_and_groups_are_one_seed(member):
    learner, episodes = member.learner, member.task.reward
    examples = member.task.train[:2]
    batch, returns, terms = play_batch(learner, examples, episodes)
    group = learner.algorithm.group_size
    assert len(batch) == len(returns) == 2 * group
    assert torch.equal(returns, terms[:, 0])
    played = play(learner, episodes, [examples[0].question], repeats=2)
    assert [t.seed for t in played] == [examples[0].question] * 2
    for t in played:
        assert t.episode_return == pytest.approx(sum(t.rewards))


def test_builtin_rewards():
    env = GuessNumberEnv(low=1, high=8, step_penalty=0.25)
    env.reset(1)
    secret = env.secret
    wrong = 1 if secret != 1 else 2
    assert env.step(str(wrong))[:4] == (
        "Higher." if wrong < secret else "Lower.",
        0.0,
        False,
        False,
    )
    assert env.step(f"It is {secret}")[1:3] == (0.75, True)
    running = RunningSumEnv(count=3)
    running.reset(2)
    rewards = [
        running.step("ok")[1],
        running.step("ok")[1],
        running.step(str(sum(running.numbers)))[1],
    ]
    assert rewards == [0.0, 0.0, 1.0]  # the final reply alone is rewarded
    assert calculator("1234 * 5678") == str(1234 * 5678)
    assert calculator("__import__('os')").startswith("error")


def test_seeds_are_disjoint_and_the_same_for_every_member():
    cfg = manifest_from_dict(
        {"task": {"env": {"class": "builtin:running_sum"}, "eval_size": 16}}
    ).task
    train, held_out = episode_seeds(cfg, 3)
    assert len(held_out) == 16 and len(train) == 2048
    assert not {e.question for e in train} & {e.question for e in held_out}
    assert episode_seeds(cfg, 3) == (train, held_out) and episode_seeds(cfg, 4) != (train, held_out)


# -- failing environments: one line each -----------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "says"),
    [
        ("Raises", "raised KeyError: 'no such move'"),
        ("Hangs", "ran past task.env_timeout_s (0.5 s)"),
        ("BadReward", "returned the reward '1.0' (str)"),
        ("NoMaxTurns", "max_turns at turn 0"),
    ],
)
def test_a_failing_environment_fails_with_one_line(member, tmp_path, cls, says):
    episodes = _episodes(member, tmp_path, cls, timeout_s=0.5)
    tok, eos = member.tokenizer, member.tokenizer.eos_token_id
    reply = tok("go", add_special_tokens=False)["input_ids"] + [eos]
    with pytest.raises(EnvError) as caught:
        play(member.learner, episodes, [1], sampler=_scripted([reply] * 3))
    message = str(caught.value)
    assert "\n" not in message and says in message
    assert message.startswith(f"environment {cls} (envs.py)")
    if cls != "NoMaxTurns":
        assert "turn 1 on action 'go'" in message
    assert caught.value.reproduced is (cls != "Hangs")
    # a campaign does not retry a reproduced failure (the same member fails the same way)
    assert classify(caught.value) == (None if cls == "Hangs" else "reward_error")


def test_check_env_plays_one_turn(tmp_path):
    (tmp_path / "envs.py").write_text(BAD_ENVS)
    for cls, says in [("Base", None), ("Raises", "raised KeyError"), ("NoMaxTurns", "max_turns")]:
        manifest = manifest_from_dict(
            {"task": {"env": {"file": "envs.py", "class": cls}}}, base_dir=tmp_path
        )
        problems = check_env(manifest.task, tmp_path, 0)
        assert (problems == []) if says is None else (len(problems) == 1 and says in problems[0])


# -- the manifest section --------------------------------------------------------------------


def test_env_section_errors_are_one_line_each(tmp_path):
    (tmp_path / "game.py").write_text(textwrap.dedent("class Game:\n    max_turns = 2\n"))
    cases = [
        ({"env": {"file": "game.py", "class": "Gmae"}}, "task.env.class ('Gmae') is not defined"),
        ({"env": {"file": "nope.py", "class": "Game"}}, "task.env.file ('nope.py') cannot be read"),
        ({"env": {"class": "Game"}}, "task.env.file is required for class 'Game'"),
        ({"env": {"class": "builtin:chess"}}, "is not a built-in environment"),
        (
            {"env": {"file": "game.py", "clas": "Game"}},
            "task.env.clas is not a known key; did you mean 'class'?",
        ),
        (
            {"env": {"class": "builtin:guess_number"}, "name": "builtin:letters"},
            "task.name is set with task.env",
        ),
        ({"env": {"class": "builtin:guess_number", "max_turns": 0}}, "task.env.max_turns (0)"),
    ]
    for task, says in cases:
        with pytest.raises(ConfigError) as caught:
            manifest_from_dict({"task": task}, base_dir=tmp_path)
        assert any(says in p for p in caught.value.problems), (says, caught.value.problems)
    with pytest.raises(ConfigError, match=r"task\.env trains with GRPO or REINFORCE"):
        manifest_from_dict(
            {"task": {"env": {"class": "builtin:guess_number"}}, "algorithm": {"name": "PPO"}}
        )


def test_the_static_engine_plays_the_same_greedy_episodes_as_generate(member, tmp_path):
    manifest = small_manifest(
        tmp_path,
        task={"env": {"class": "builtin:guess_number"}, "eval_size": 4, "name": None},
        rollout={"engine": "static"},
    )
    static = Member(manifest, CPU)
    static.model.load_state_dict(member.model.state_dict())
    episodes = dataclasses.replace(member.task.reward, max_turns=3)
    seeds = [e.question for e in member.task.eval[:2]]
    expected = play(member.learner, episodes, seeds, greedy=True)
    played = play(static.learner, episodes, seeds, greedy=True)
    assert [t.ids for t in played] == [t.ids for t in expected]
    assert [t.sampled for t in played] == [t.sampled for t in expected]
