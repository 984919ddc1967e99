"""Members of one shared base trained together (:mod:`pbt.algorithms.runtime.population_train`)
against each member trained alone (float32, CPU, the tiny model).

In lock step, with one batched rollout and each member learning in turn: bit for bit. With the
updates as one (``launch.batched_train``): one pass's log-probs and each member's gradient from
it within float32 rounding (the base layers multiply all members' rows at once, and the CPU's
BLAS may round a row differently in a product of more rows: 1.4e-6 on a log-prob of ~10, seen
at 2 rows a member against 6), and after two updates of four Adam steps each member's adapter
and moments within 1e-3 of their scale: Adam's ``g / sqrt(v)`` amplifies such a difference in a
near-zero gradient element (seen: ~1e-4 of a weight). Many layouts agree bit for bit; none is
promised to."""

from __future__ import annotations

import pytest
import torch
from support import small_manifest

from pbt.algorithms.passes import LogProbs
from pbt.algorithms.rollout.hf import sequence_logprobs
from pbt.algorithms.runtime import population_train
from pbt.algorithms.runtime.population_batch import row_adapters
from pbt.algorithms.runtime.population_train import (
    backward_together,
    evaluate_together,
    learn_together,
    learns_together,
    logprobs_together,
    train_together,
)
from pbt.algorithms.runtime.shared_base import SharedBase

CPU = torch.device("cpu")
HYPERPARAMETERS = [  # each member its own lr and sampling temperature (a per-row temperature)
    {"lr": 5e-2, "temperature": 1.0},
    {"lr": 2e-2, "temperature": 0.7},
    {"lr": 8e-2, "temperature": 1.3},
]
ALGORITHM = {  # two mini-batches of 8 rows an epoch, two epochs, a KL term
    "group_size": 4,
    "prompts_per_step": 4,
    "mini_batch_size": 8,
    "update_epochs": 2,
    "beta": 0.05,
    "collapse_patience": 1,  # a member whose step has no signal stops (none does, but below)
}


def _shared(tmp_path, per_batch: int, batched_train: bool, kernel: str = "auto") -> SharedBase:
    manifest = small_manifest(
        tmp_path,
        algorithm=ALGORITHM,
        rollout={"max_output_tokens": 8},
        launch={
            "members_per_batch": per_batch,
            "batched_train": batched_train,
            "lora_kernel": kernel,
        },
    )
    shared = SharedBase(manifest, CPU)
    for i, values in enumerate(HYPERPARAMETERS):
        shared.add(f"m{i}", seed=100 + i).learner.apply_hyperparameters(values)
    return shared


def _state(shared: SharedBase, member_id: str) -> list[torch.Tensor]:
    """The member's adapter and every tensor of its optimizer state."""
    member = shared.activate(member_id)
    tensors = [p.detach().clone() for p in shared.params]
    for param in shared.params:
        state = member.learner.optimizer.state.get(param, {})
        tensors += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
    return tensors


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Each member trained two steps alone, in turn: its steps' metrics and its state."""
    shared = _shared(tmp_path_factory.mktemp("alone"), 1, False)
    out = {}
    for member_id in shared.members:
        history = shared.activate(member_id).train(2)
        out[member_id] = (history, _state(shared, member_id))
    return out


def _without_timings(history):
    drop = ("tokens_per_s", "step_time_s")
    return [{k: v for k, v in step.items() if k not in drop} for step in history]


def test_members_in_lock_step_train_as_alone_bit_for_bit(tmp_path, alone):
    shared = _shared(tmp_path, 3, False)
    assert not learns_together(shared)
    trained = train_together(shared, list(shared.members), 2)
    assert shared.row_adapters is not None  # the rollouts went through one batch
    for member_id, (history, state) in alone.items():
        assert trained[member_id].error is None
        assert _without_timings(trained[member_id].history) == _without_timings(history)
        together = _state(shared, member_id)
        assert all(torch.equal(a, b) for a, b in zip(state, together, strict=True)), member_id


def test_a_hosts_next_batch_reuses_its_stacked_adapters_and_trains_as_alone(tmp_path, alone):
    """A long-lived worker makes a holder of members per batch of tasks, on its one host: the
    next batch loads its members into the first one's stacked adapters, which the batched
    decoder's captured graphs read, and trains as alone; a larger batch makes a new set, and
    the decoder keys its graphs by the set."""
    first = _shared(tmp_path, 3, False)
    train_together(first, list(first.members), 1)
    stacked, model = first.row_adapters, first.host.model
    second = SharedBase(first.manifest, CPU, host=first.host)
    for i, values in enumerate(HYPERPARAMETERS):
        second.add(f"m{i}", seed=100 + i).learner.apply_hyperparameters(values)
    trained = train_together(second, list(second.members), 2)
    assert second.row_adapters is stacked
    for member_id, (history, state) in alone.items():
        assert _without_timings(trained[member_id].history) == _without_timings(history)
        together = _state(second, member_id)
        assert all(torch.equal(a, b) for a, b in zip(state, together, strict=True)), member_id
    made = model.pbt_row_adapters_made
    assert row_adapters(second, 4) is not stacked
    assert model.pbt_row_adapters_made == made + 1


def test_the_batched_decoder_keys_its_graphs_by_the_stacked_adapters(tmp_path):
    manifest = small_manifest(
        tmp_path,
        rollout={"engine": "static", "max_output_tokens": 4},
        launch={"members_per_batch": 2},
    )
    shared = SharedBase(manifest, CPU)
    for i in range(2):
        shared.add(f"m{i}", seed=i)
    train = shared.host.task.train
    questions = {
        m: [ex.chat for ex in shared.member(m).learner.sample_prompts(train)]
        for m in shared.members
    }
    shared.complete_all(questions)
    model = shared.host.model
    (key,) = model.pbt_batched_decoder._states
    assert key[-1] == model.pbt_row_adapters_made
    row_adapters(shared, 3)  # remade larger: a new set, so a layout is captured anew
    shared.complete_all(questions)
    assert {k[-1] for k in model.pbt_batched_decoder._states} == {key[-1], key[-1] + 1}


@pytest.mark.parametrize("kernel", ["auto", "stacked"])
def test_a_batched_train_step_learns_each_member_as_alone(tmp_path, alone, kernel):
    """``launch.batched_train`` in the training loop: the first step's rollouts are each
    member's own (the same adapters), its update equal within rounding; with either kernel
    (``auto`` is ``segmented`` on a CPU)."""
    shared = _shared(tmp_path, 3, True, kernel)
    trained = train_together(shared, list(shared.members), 1)
    for member_id, (history, _) in alone.items():
        assert trained[member_id].error is None
        got, want = trained[member_id].history[0], history[0]
        assert got["reward_mean"] == want["reward_mean"]  # the same tokens
        assert got["optimizer_steps"] == want["optimizer_steps"] == 4
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_a_collapsed_member_stops_and_the_others_train_on_as_alone(tmp_path, alone):
    shared = _shared(tmp_path, 3, False)
    # near-greedy: every completion of a group the same, so no reward spread and no signal
    shared.member("m1").learner.apply_hyperparameters({"temperature": 1e-4})
    trained = train_together(shared, list(shared.members), 2)
    collapsed = shared.member("m1")
    assert collapsed.stopped and len(trained["m1"].history) == 1 and trained["m1"].error is None
    for member_id in ("m0", "m2"):
        history, state = alone[member_id]
        assert _without_timings(trained[member_id].history) == _without_timings(history)
        together = _state(shared, member_id)
        assert all(torch.equal(a, b) for a, b in zip(state, together, strict=True)), member_id


def _stacked(shared: SharedBase, ids: list[str]):
    """Every member's adapter in its slot of the shared base's row adapters, trainable; and the
    slots by member."""
    shared.store_active()
    adapters = row_adapters(shared, len(ids))
    names = [name for name, _ in shared.host.named_trainable]
    slots = {member_id: slot for slot, member_id in enumerate(ids)}
    for member_id, slot in slots.items():
        adapters.load(slot, dict(zip(names, shared.adapter_of(member_id), strict=True)))
    for t in adapters.a + adapters.b:
        t.requires_grad_(True)
    return adapters, slots


@pytest.mark.parametrize("batched_train", [False, True])
def test_a_diverged_member_fails_alone_and_the_others_train_on(tmp_path, alone, batched_train):
    """A member whose adapter went NaN samples alone, outside the batch, and fails there as it
    would alone (NaN probabilities); the others train every step: as alone, bit for bit, when
    learning in turn."""
    shared = _shared(tmp_path, 3, batched_train, "stacked")
    shared.store_active()
    for tensor in shared.adapter_of("m1"):
        tensor.fill_(float("nan"))
    shared.restore_active()
    trained = train_together(shared, list(shared.members), 2)
    assert isinstance(trained["m1"].error, RuntimeError) and not trained["m1"].history
    assert "nan" in str(trained["m1"].error)
    for member_id in ("m0", "m2"):
        history, state = alone[member_id]
        assert trained[member_id].error is None and len(trained[member_id].history) == 2
        if not batched_train:
            assert _without_timings(trained[member_id].history) == _without_timings(history)
            together = _state(shared, member_id)
            assert all(torch.equal(a, b) for a, b in zip(state, together, strict=True))


@pytest.mark.parametrize("kernel", ["segmented", "stacked"])
def test_one_pass_gives_each_member_its_own_logprobs_and_gradient(tmp_path, kernel):
    shared = _shared(tmp_path, 3, True)
    model, ids = shared.host.model, list(shared.members)
    asks, alone = {}, {}
    for member_id in ids:
        member = shared.activate(member_id)
        with (
            torch.no_grad()
        ):  # a distinct adapter each, B not zero: every LoRA matrix has a gradient
            for param in shared.params:
                param.add_(
                    torch.randn(param.shape, generator=torch.Generator().manual_seed(len(asks)))
                    * 0.1
                )
        examples = member.learner.sample_prompts(member.task.train)[:1]
        rows = member.learner.complete([ex.chat for ex in examples]).select(slice(0, 2))
        asks[member_id] = LogProbs(rows, member.learner.rollout_cfg.temperature, grad=True)
        logp = sequence_logprobs(model, rows, asks[member_id].temperature)
        (logp * rows.completion_mask).sum().backward()
        alone[member_id] = (
            logp.detach(),
            {n: p.grad.clone() for n, p in shared.host.named_trainable},
        )
        member.learner.optimizer.zero_grad(set_to_none=True)
    adapters, slots = _stacked(shared, ids)
    together = logprobs_together(model, adapters, slots, asks, kernel)
    torch.stack([(together[m] * asks[m].rows.completion_mask).sum() for m in ids]).sum().backward()
    for member_id, (logp, grads) in alone.items():
        torch.testing.assert_close(together[member_id], logp, rtol=0, atol=1e-5)
        got = adapters.named_grads(slots[member_id])
        for name, grad in grads.items():
            assert float((got[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name


def test_one_forward_and_backward_update_each_member_as_alone(tmp_path):
    """The same scored batches learned from twice: each member in turn, and all members'
    updates as one (every pass of the three members' updates in one forward or backward)."""
    turns, together = _shared(tmp_path / "t", 3, True), _shared(tmp_path / "b", 3, True)
    assert learns_together(together)
    ids = list(turns.members)
    for _ in range(2):
        scored = {}
        for member_id in ids:
            member = turns.activate(member_id)
            examples = member.learner.sample_prompts(member.task.train)
            batch = member.learner.complete([ex.chat for ex in examples])
            rewards = member.learner.score(examples, batch, member.task.reward)
            scored[member_id] = (batch, rewards)
            assert member.learner.learn(batch, rewards)["skipped"] == 0.0
        steps = {m: together.member(m).learner.learn_steps(b, r) for m, (b, r) in scored.items()}
        results = learn_together(together, steps)
        assert all(isinstance(r, dict) and r["optimizer_steps"] == 4 for r in results.values())
    moved = []
    for member_id in ids:
        want, got = _state(turns, member_id), _state(together, member_id)
        for a, b in zip(want, got, strict=True):  # Adam amplifies a pass's rounding (above)
            assert float((a - b).abs().max()) <= 1e-3 * float(a.abs().max()), member_id
        moved.append(want[0])
    assert not torch.equal(moved[0], moved[1])  # the members learned apart


@pytest.mark.parametrize("rows", [3, population_train.EVAL_ROWS])
def test_members_evaluated_together_score_as_each_alone(tmp_path, monkeypatch, rows):
    """Greedy evaluations sampled in one batch, ``rows`` questions a member a call (3: the
    eval split in several calls, the last short): each member's fitness is what its own
    ``evaluate`` gives with as many questions a call."""
    monkeypatch.setattr(population_train, "EVAL_ROWS", rows)
    shared = _shared(tmp_path, 3, False)
    train_together(shared, list(shared.members), 1)  # adapters apart
    alone = {}
    for member_id in shared.members:
        member = shared.activate(member_id)
        task = member.task
        alone[member_id] = member.learner.evaluate(task.eval, task.reward, 0.0, batch_size=rows)
    assert len(shared.member("m0").task.eval) > rows or rows == population_train.EVAL_ROWS
    assert evaluate_together(shared, list(shared.members), 0.0) == alone


def test_a_member_whose_forward_overflows_leaves_the_others_gradients_alone(tmp_path):
    """Stacked: a member whose adapter is finite but so large that its rows overflow gives
    non-finite log-probs; the pass runs again segmented and its loss is left out of the
    backward, so the other members' gradients are finite and as alone."""
    shared = _shared(tmp_path, 3, True, "stacked")
    model, ids = shared.host.model, list(shared.members)
    asks, alone = {}, {}
    for i, member_id in enumerate(ids):
        member = shared.activate(member_id)
        examples = member.learner.sample_prompts(member.task.train)[:1]
        rows = member.learner.complete([ex.chat for ex in examples]).select(slice(0, 2))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():  # sampled first: m1's overflowing adapter cannot sample
            for param in shared.params:
                param.add_(torch.randn(param.shape, generator=gen) * (1e15 if i == 1 else 0.1))
        asks[member_id] = LogProbs(rows, 1.0, grad=True)
        if i != 1:
            (sequence_logprobs(model, rows, 1.0) * rows.completion_mask).sum().backward()
            alone[member_id] = {n: p.grad.clone() for n, p in shared.host.named_trainable}
            member.learner.optimizer.zero_grad(set_to_none=True)
    adapters, slots = _stacked(shared, ids)
    assert adapters.finite == [True] * 3
    together = logprobs_together(model, adapters, slots, asks, "stacked")
    assert not torch.isfinite(together["m1"]).all()
    backward_together([(together[m] * asks[m].rows.completion_mask).sum() for m in ids])
    for member_id, grads in alone.items():
        got = adapters.named_grads(slots[member_id])
        for name, grad in grads.items():
            assert torch.isfinite(got[name]).all(), name
            assert float((got[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name
