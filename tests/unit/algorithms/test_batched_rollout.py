"""Several members' rollouts in one batch (:mod:`pbt.algorithms.rollout.batched`) against each
member sampled alone: the same tokens (float32, CPU) and the same random stream
afterwards, on the static engine and on Hugging Face ``generate``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support import small_manifest

from pbt.algorithms.rollout.batched import MemberRollout, generate_batched
from pbt.algorithms.rollout.hf import generate
from pbt.algorithms.runtime.lora_batch import RowAdapters, segments_of
from pbt.algorithms.runtime.member import Member

CPU = torch.device("cpu")
QUESTIONS = [
    ["Write the letter q over and over.", "hello"],
    ["Tom has 3 apples and buys 5 more. How many apples does Tom have now?"],
    ["a b", "spell cat backwards", "x"],
]
SAMPLING = [  # temperature, top_k, top_p, greedy (one greedy member among sampled ones)
    (1.0, 0, 1.0, False),
    (0.7, 5, 0.9, False),
    (1.3, 0, 0.8, True),  # greedy: its temperature and top-p are not used
]


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batched")
    member = Member(small_manifest(tmp, rollout={"max_output_tokens": 40}), CPU)
    member.learner.model.eval()
    return member


def _adapter(member, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=gen) * 0.3 for name, p in member.learner.named_params
    }


def _load(member, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in member.learner.named_params:
            p.copy_(weights[name])


def _solo(member, engine: str, weights, questions, sampling, seed: int):
    temperature, top_k, top_p, greedy = sampling
    _load(member, weights)
    cfg = dataclasses.replace(
        member.learner.rollout_cfg, engine=engine, temperature=temperature, top_k=top_k, top_p=top_p
    )
    torch.manual_seed(seed)
    batch = generate(
        member.learner.model, member.learner.tokenizer, questions, cfg, repeats=3, greedy=greedy
    )
    return batch, torch.get_rng_state()


def _batched(member, engine: str, adapters, kernel="segmented"):
    members = [
        MemberRollout(
            slot=i,
            questions=q,
            repeats=3,
            generator=torch.Generator().manual_seed(100 + i),
            temperature=t,
            top_k=k,
            top_p=p,
            greedy=g,
        )
        for i, (q, (t, k, p, g)) in enumerate(zip(QUESTIONS, SAMPLING, strict=True))
    ]
    cfg = dataclasses.replace(member.learner.rollout_cfg, engine=engine)
    batches = generate_batched(
        member.learner.model, member.learner.tokenizer, adapters, members, cfg, kernel=kernel
    )
    return batches, [m.generator.get_state() for m in members]


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_each_member_samples_as_alone(member, engine):
    """Three members with their own adapters, prompts (of different widths), temperature,
    top-k and top-p in one batch: each member's completions and its stream afterwards equal
    its solo rollout's from the same stream state."""
    weights = [_adapter(member, seed) for seed in range(len(QUESTIONS))]
    adapters = RowAdapters(member.learner.model, slots=len(QUESTIONS))
    for slot, w in enumerate(weights):
        adapters.load(slot, w)
    batches, streams = _batched(member, engine, adapters)
    texts = set()
    for i, (q, sampling) in enumerate(zip(QUESTIONS, SAMPLING, strict=True)):
        alone, stream = _solo(member, engine, weights[i], q, sampling, 100 + i)
        got = batches[i]
        assert torch.equal(got.prompt_ids, alone.prompt_ids)
        assert torch.equal(got.completion_ids, alone.completion_ids), f"member {i}"
        assert torch.equal(got.completion_mask, alone.completion_mask)
        assert got.texts == alone.texts
        assert torch.equal(stream, streams[i]), f"member {i}'s stream"
        texts.update(got.texts)
    assert len(texts) > 3  # the adapters and the sampling make the rows differ


@pytest.mark.parametrize("engine", ["static", "hf"])
def test_a_member_that_ends_first_leaves_its_stream_as_alone(member, engine):
    """The output layer made to favour end-of-sequence, so one member's rows all end while the
    others' run on: its completions are cut where its solo rollout stops, and its stream is
    where its solo rollout leaves it (not advanced by the batch's further steps)."""
    model, tokenizer = member.learner.model, member.learner.tokenizer
    head = model.get_base_model().get_output_embeddings()
    eos, saved = tokenizer.eos_token_id, head.weight.detach().clone()
    ids = tokenizer(["hello there", "a b c d"], return_tensors="pt", padding=True)
    try:
        with torch.no_grad():
            hidden = model(**ids, output_hidden_states=True).hidden_states[-1]
            mean = hidden.reshape(-1, hidden.shape[-1]).mean(dim=0)
            head.weight[eos] = mean / mean.norm() ** 2 * 15.0  # an end logit of ~15 on average
        test_each_member_samples_as_alone(member, engine)
        adapters = RowAdapters(model, slots=len(QUESTIONS))
        for slot, seed in enumerate(range(len(QUESTIONS))):
            adapters.load(slot, _adapter(member, seed))
        lengths = [b.completion_ids.shape[1] for b in _batched(member, engine, adapters)[0]]
        assert min(lengths) < max(lengths) == 40  # one member stopped early, the batch ran on
    finally:
        with torch.no_grad():
            head.weight.copy_(saved)


def test_stacked_kernel_agrees(member):
    """The stacked kernel (one matmul pair for every member) gives each row its own member's
    output: its logits equal the segmented kernel's within float32 rounding."""
    weights = [_adapter(member, seed) for seed in range(3)]
    adapters = RowAdapters(member.learner.model, slots=3)
    for slot, w in enumerate(weights):
        adapters.load(slot, w)
    ids = torch.randint(3, 100, (7, 9), generator=torch.Generator().manual_seed(0))
    segments = segments_of([2, 1, 4])
    out = {}
    with torch.no_grad():
        for kernel in ("segmented", "stacked"):
            with adapters.rows(segments, kernel):
                out[kernel] = member.learner.model(input_ids=ids).logits
        _load(member, weights[2])
        alone = member.learner.model(input_ids=ids[3:]).logits
    torch.testing.assert_close(out["segmented"][3:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["stacked"], out["segmented"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out["segmented"][:2], out["segmented"][3:5])


@pytest.mark.parametrize("kernel", ["segmented", "stacked"])
def test_a_broken_member_stays_its_own(member, kernel):
    """A member whose adapter went non-finite (a diverged step) poisons only its own rows: the
    other members' logits in the same batch are finite and equal their solo forwards (within a
    BLAS's rounding of a larger batch). Asked for ``stacked``, such a batch runs
    ``segmented`` (in the shared products the NaN would reach every row)."""
    weights = [_adapter(member, seed) for seed in range(3)]
    weights[1] = {name: torch.full_like(t, float("nan")) for name, t in weights[1].items()}
    adapters = RowAdapters(member.learner.model, slots=3)
    for slot, w in enumerate(weights):
        adapters.load(slot, w)
    ids = torch.randint(3, 100, (6, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert adapters.finite == [True, False, True]
        assert adapters.kernel(segments_of([2, 2, 2]), kernel) == "segmented"
        with adapters.rows(segments_of([2, 2, 2]), kernel):
            together = member.learner.model(input_ids=ids).logits
        for slot, rows in ((0, slice(0, 2)), (2, slice(4, 6))):
            _load(member, weights[slot])
            alone = member.learner.model(input_ids=ids[rows]).logits
            torch.testing.assert_close(together[rows], alone, rtol=1e-5, atol=1e-5)
    assert torch.isnan(together[2:4]).all()
    adapters.clear(1)  # left out of a batch: the stacked products are safe again
    assert adapters.finite == [True] * 3
    assert adapters.kernel(segments_of([2, 0, 2]), kernel) == kernel
