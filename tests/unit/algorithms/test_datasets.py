"""SFT and preference datasets, their tokenisation, and the SFT and DPO losses."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pbt.algorithms import preference
from pbt.algorithms.data.supervised import (
    PreferenceExample,
    SFTExample,
    encode_pairs,
    load_preferences,
    load_sft,
)
from pbt.algorithms.data.tasks import LETTER_TEMPLATES, letters_reward, load_task
from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
from pbt.algorithms.runtime.models import load_base_model, load_tokenizer
from pbt.config import ModelConfig, TaskConfig
from pbt.config.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


# --- builtin:letters ------------------------------------------------------------------------


def _letter_of(prompt: str) -> str:
    """The letter a letters prompt asks for, recovered from its template."""
    for template in LETTER_TEMPLATES:
        head, tail = template.split("{c}")
        if prompt.startswith(head) and prompt.endswith(tail):
            return prompt[len(head) : len(prompt) - len(tail)]
    raise AssertionError(f"not a letters prompt: {prompt!r}")


def _letters(train_size: int, eval_size: int) -> TaskConfig:
    return TaskConfig(train_size=train_size, eval_size=eval_size)


@pytest.mark.parametrize("loader", [load_sft, load_preferences])
def test_letters_splits_are_sized_disjoint_and_deterministic(loader):
    data = loader(_letters(100, 20), ".", seed=3)
    assert (len(data.train), len(data.eval)) == (100, 20)
    assert not {e.prompt for e in data.train} & {e.prompt for e in data.eval}
    again = loader(_letters(100, 20), ".", seed=3)
    assert again == data
    other = loader(_letters(100, 20), ".", seed=4)
    assert other.eval != data.eval


def test_letters_holds_out_the_same_prompts_as_the_rl_task():
    data = load_sft(_letters(150, 30), ".", seed=5)
    task = load_task(TaskConfig(train_size=150, eval_size=30), ".", seed=5)
    assert [e.prompt for e in data.eval] == [e.question for e in task.eval]


def test_letters_sft_responses_are_short_runs_of_the_requested_letter():
    data = load_sft(_letters(50, 10), ".", seed=0)
    for ex in [*data.train, *data.eval]:
        letter = _letter_of(ex.prompt)
        assert ex.response.split() == [letter] * 6
        assert letters_reward(ex.response, letter, ex.prompt) == 1.0


def test_letters_preferences_rank_the_requested_letter_first():
    data = load_preferences(_letters(150, 50), ".", seed=0)
    for ex in [*data.train, *data.eval]:
        letter = _letter_of(ex.prompt)
        assert ex.chosen.split() == [letter] * 6 and ex.chosen != ex.rejected
        assert letter not in ex.rejected.split()
        assert letters_reward(ex.chosen, letter, "") > letters_reward(ex.rejected, letter, "")
        assert len(set(ex.rejected.split())) > 1  # a mix of letters, not another run


# --- the user's files -----------------------------------------------------------------------


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _file(train: str, **keys) -> TaskConfig:
    return TaskConfig(train=train, **{"eval_fraction": 0.3, "eval_size": 64, **keys})


def test_jsonl_sft_file_is_split_by_seed(tmp_path):
    rows = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(10)]
    _write(tmp_path / "sft.jsonl", [*rows[:5], "", *rows[5:]])  # a blank line is skipped
    data = load_sft(_file("sft.jsonl"), tmp_path, seed=1)
    assert len(data.eval) == 3 and len(data.train) == 7
    assert sorted([*data.train, *data.eval], key=lambda e: int(e.prompt[1:])) == [
        SFTExample(**r) for r in rows
    ]
    assert load_sft(_file("sft.jsonl"), tmp_path, seed=1) == data
    assert load_sft(_file("sft.jsonl"), tmp_path, seed=2).eval != data.eval
    assert len(load_sft(_file("sft.jsonl", train_size=4), tmp_path, seed=1).train) == 4
    assert len(load_sft(_file("sft.jsonl", eval_size=2), tmp_path, seed=1).eval) == 2


def test_jsonl_preferences_keep_every_pair_of_an_eval_prompt_out_of_train(tmp_path):
    rows = [{"prompt": f"p{i // 2}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(12)]
    _write(tmp_path / "dpo.jsonl", rows)
    data = load_preferences(_file("dpo.jsonl", eval_fraction=0.25), tmp_path, seed=0)
    assert len(data.eval) == 3
    assert all(isinstance(e, PreferenceExample) for e in [*data.train, *data.eval])
    held_out = {e.prompt for e in data.eval}
    assert not {e.prompt for e in data.train} & held_out
    kept = [*data.train, *data.eval]
    dropped = [r for r in rows if PreferenceExample(**r) not in kept]
    assert dropped and all(r["prompt"] in held_out for r in dropped)


def test_field_names_template_and_system_prompt_are_the_manifests(tmp_path):
    rows = [{"q": f"p{i}", "good": f"c{i}", "bad": f"r{i}", "topic": "t"} for i in range(6)]
    _write(tmp_path / "dpo.jsonl", rows)
    cfg = _file(
        "dpo.jsonl",
        chosen_field="good",
        rejected_field="bad",
        prompt_template="{topic}: {q}",
        system_prompt="Be brief.",
    )
    data = load_preferences(cfg, tmp_path, seed=0)
    first = min([*data.train, *data.eval], key=lambda e: e.chosen)
    assert first == PreferenceExample("t: p0", "c0", "r0", "Be brief.")
    assert first.chat[0] == {"role": "system", "content": "Be brief."}


SFT_ROW = {"prompt": "p", "response": "r"}


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (None, ["not found", "relative to the manifest's folder"]),
        ([], ["holds no rows", "add rows"]),
        ([SFT_ROW, "{oops"], ["line 2 of", "not valid JSON", "fix the line"]),
        ([SFT_ROW, "[1, 2]"], ["line 2 of", "not an object", "one object per line"]),
        ([{"prompt": "p"}], ["task.response_field ('response')", "have: prompt"]),
        ([SFT_ROW, {"prompt": "p", "response": 3}], ["task.response_field", "quote"]),
    ],
)
def test_bad_sft_files_are_clear_errors(tmp_path, lines, expected):
    if lines is not None:
        _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(ConfigError) as err:
        load_sft(_file("d.jsonl"), tmp_path, seed=0)
    message = str(err.value)
    assert "task.train ('d.jsonl')" in message
    for part in expected:
        assert part in message


def test_a_pair_that_prefers_a_response_to_itself_is_named(tmp_path):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    _write(tmp_path / "d.jsonl", [good, good, {**good, "rejected": "a"}, good])
    with pytest.raises(
        ConfigError, match=r"1 row\(s\) \(row 3\) have the same chosen and rejected"
    ):
        load_preferences(_file("d.jsonl"), tmp_path, seed=0)


def test_a_file_in_task_name_points_to_task_train_and_unknown_formats_are_clear(tmp_path):
    with pytest.raises(ConfigError, match=r"task.name \('builtin:nope'\) is not a dataset"):
        load_sft(TaskConfig(name="builtin:nope"), tmp_path, seed=0)
    with pytest.raises(ConfigError, match=r"your own rows go in task.train"):
        load_sft(TaskConfig(name="d.jsonl"), tmp_path, seed=0)
    (tmp_path / "d.txt").write_text("p\tr\n")
    with pytest.raises(ConfigError, match=r"extension '.txt', which is not read; use .jsonl"):
        load_sft(_file("d.txt"), tmp_path, seed=0)


# --- encode_pairs ---------------------------------------------------------------------------


def test_encode_pairs_layout(tokenizer):
    responses = ["q q q q q q", "hello", "a b c d e f g h i j"]
    batch = encode_pairs(tokenizer, ["Say q.", "Say hi.", "Count."], responses, max_tokens=8)
    assert isinstance(batch, RolloutBatch)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = batch.completion_mask.sum(dim=1).long().tolist()
    assert lengths[2] == 8 and batch.completion_ids.shape[1] == 8  # truncated: 7 tokens + EOS
    for row, n in enumerate(lengths):
        ids = batch.completion_ids[row].tolist()
        assert ids[n - 1] == eos and ids[n:] == [pad] * (8 - n)
        assert (
            batch.completion_mask[row, :n].eq(1).all()
            and batch.completion_mask[row, n:].eq(0).all()
        )
        assert tokenizer.decode(ids[: n - 1]) == batch.texts[row]
    assert batch.texts[:2] == responses[:2]
    assert batch.texts[2] == tokenizer.decode(tokenizer(responses[2])["input_ids"][:7])
    assert batch.prompt_mask[:, -1].eq(1).all()  # left-padded
    prompt = tokenizer.decode(batch.prompt_ids[1][batch.prompt_mask[1].bool()])
    assert prompt == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"


def test_encode_pairs_keeps_a_literal_eos_in_the_text_as_text(tokenizer):
    batch = encode_pairs(tokenizer, ["x"], ["a<|im_end|>b"], max_tokens=32)
    ids = batch.completion_ids[0].tolist()
    assert ids.count(tokenizer.eos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id


def test_encoded_pairs_are_scored_by_sequence_logprobs(tokenizer):
    model = load_base_model(ModelConfig(), torch.device("cpu"))
    prompts, responses = ["Say q.", "Only write z."], ["q q q", "z z z z z z z z z z"]
    batch = encode_pairs(tokenizer, prompts, responses, max_tokens=6)
    with torch.no_grad():
        logp = sequence_logprobs(model, batch, temperature=1.0)
        alone = sequence_logprobs(
            model, encode_pairs(tokenizer, prompts[:1], responses[:1], 6), 1.0
        )
    assert logp.shape == batch.completion_ids.shape == (2, 6)
    assert torch.isfinite(logp).all() and (logp <= 0).all()
    # padding on either side does not change the scores of a row's real tokens
    assert logp[0, :4] == pytest.approx(alone[0].tolist(), abs=1e-4)


# --- losses ---------------------------------------------------------------------------------


def test_sft_loss_terms_combine_micro_batches_exactly():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    total, count = preference.sft_loss_terms(logp, mask)
    assert (total.item(), count.item()) == (3.5, 3.0)
    (t1, c1), (t2, c2) = (
        preference.sft_loss_terms(logp[i : i + 1], mask[i : i + 1]) for i in (0, 1)
    )
    assert ((t1 + t2) / (c1 + c2)).item() == pytest.approx(3.5 / 3)


def test_dpo_loss_against_hand_values():
    pc, pr = torch.tensor([-3.0, -5.0, -2.0]), torch.tensor([-4.0, -4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -4.0, -2.0]), torch.tensor([-3.0, -4.5, -2.0])
    # log-ratio differences: (0.5 - -1.0) = 1.5, (-1.0 - 0.5) = -1.5, 0 (a tie)
    loss, margin, acc = preference.dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert margin.tolist() == pytest.approx([0.15, -0.15, 0.0])
    # -log sigmoid(m) = log(1 + exp(-m))
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-m)) for m in (0.15, -0.15, 0.0)])
    assert acc.tolist() == [1.0, 0.0, 0.0]
    assert preference.preference_accuracy(pc, pr, rc, rr).tolist() == [1.0, 0.0, 0.0]


def test_dpo_accuracy_ignores_beta_while_the_margin_scales_with_it():
    pc, pr, rc, rr = (torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(4))
    _, margin_small, acc_small = preference.dpo_loss(pc, pr, rc, rr, beta=0.1)
    _, margin_large, acc_large = preference.dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert torch.equal(acc_small, acc_large)
    assert margin_large.tolist() == pytest.approx((5 * margin_small).tolist(), rel=1e-5)
    assert 0 < acc_small.mean() < 1


def test_dpo_gradient_wrt_policy_chosen():
    pc = torch.tensor([-3.0, -5.0], requires_grad=True)
    pr = torch.tensor([-4.0, -4.0], requires_grad=True)
    rc, rr = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -4.5])
    beta = 0.3
    loss, margin, _ = preference.dpo_loss(pc, pr, rc, rr, beta)
    assert not margin.requires_grad
    loss.sum().backward()
    expected = [-beta / (1 + math.exp(m)) for m in (beta * 1.5, beta * -1.5)]  # -beta*sigmoid(-m)
    assert pc.grad.tolist() == pytest.approx(expected)
    assert pr.grad.tolist() == pytest.approx([-g for g in expected])


def test_dpo_rejects_a_non_positive_beta():
    with pytest.raises(ValueError, match=r"beta \(0.0\) must be > 0"):
        preference.dpo_loss(*(torch.zeros(1) for _ in range(4)), beta=0.0)
