"""The GRPO learner on the tiny model: updates, accumulation, zero-signal handling, mutation."""

from __future__ import annotations

import torch
from support import small_manifest

from pbt.algorithms.runtime.member import Member
from pbt.protocol.collapse import ZERO_SIGNAL_HINT

CPU = torch.device("cpu")


def _adapter(member: Member) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in member.model.named_parameters() if p.requires_grad}


def _scored_batch(member: Member):
    examples = member.learner.sample_prompts(member.task.train)
    return member.learner.rollout(examples, member.task.reward)


def test_micro_batches_accumulate_to_the_same_update(tmp_path):
    whole = Member(small_manifest(tmp_path), CPU)
    split = Member(small_manifest(tmp_path, algorithm={"micro_batch_size": 2}), CPU)
    # plain SGD, so the weight change is the gradient itself (Adam would normalise errors away)
    for member in (whole, split):
        params = [p for p in member.model.parameters() if p.requires_grad]
        member.learner.optimizer = torch.optim.SGD(params, lr=1.0)
    batch, _ = _scored_batch(whole)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0, 0.3, 0.9, 0.1])
    for aggregation in ("token-mean", "sequence-mean"):
        whole.learner.algorithm.loss_aggregation = aggregation
        split.learner.algorithm.loss_aggregation = aggregation
        whole.learner.learn(batch, rewards)
        split.learner.learn(batch, rewards)
        a, b = _adapter(whole), _adapter(split)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-7)


def test_update_raises_the_likelihood_of_better_completions(tmp_path):
    member = Member(small_manifest(tmp_path, optim={"lr": 1e-2}), CPU)
    from pbt.algorithms.rollout.hf import sequence_logprobs

    batch, _ = _scored_batch(member)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    with torch.no_grad():
        before = (sequence_logprobs(member.model, batch, 1.0) * batch.completion_mask).sum(1)
    for _ in range(3):
        member.learner.learn(batch, rewards)
    with torch.no_grad():
        after = (sequence_logprobs(member.model, batch, 1.0) * batch.completion_mask).sum(1)
    change = after - before
    assert change[0] > 0 and change[7] > 0
    assert change[[1, 2, 3]].max() < change[0] and change[[4, 5, 6]].max() < change[7]


def test_all_equal_rewards_skip_the_update_and_say_why(tmp_path):
    member = Member(small_manifest(tmp_path), CPU)
    before = _adapter(member)
    batch, _ = _scored_batch(member)
    metrics = member.learner.learn(batch, torch.full((8,), 0.5))
    assert metrics["skipped"] == 1.0 and metrics["zero_signal_fraction"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in _adapter(member).items())
    assert "group_size" in ZERO_SIGNAL_HINT and "temperature" in ZERO_SIGNAL_HINT


def test_zero_signal_groups_are_masked_and_counted(tmp_path):
    member = Member(small_manifest(tmp_path), CPU)
    batch, _ = _scored_batch(member)
    metrics = member.learner.learn(batch, torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    assert metrics["zero_signal_fraction"] == 0.5 and metrics["skipped"] == 0.0


def test_kl_term_is_zero_before_training_and_grows_after(tmp_path):
    member = Member(small_manifest(tmp_path, algorithm={"beta": 0.5}, optim={"lr": 1e-2}), CPU)
    batch, _ = _scored_batch(member)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    first = member.learner.learn(batch, rewards)
    later = member.learner.learn(batch, rewards)
    assert first["kl"] == 0.0  # LoRA B starts at zero: policy == reference
    assert later["kl"] > 0.0


def test_mutated_lr_lands_in_the_optimizer_and_keeps_adam_state(tmp_path):
    member = Member(small_manifest(tmp_path, optim={"warmup_steps": 10}), CPU)
    member.learner.train_step(member.task.train, member.task.reward)
    learner = member.learner
    moments = {id(p): s["exp_avg"].clone() for p, s in learner.optimizer.state.items()}
    position = learner.scheduler.last_epoch
    learner.apply_hyperparameters({"lr": 1e-2, "beta": 0.05})
    assert learner.scheduler.last_epoch == position == 1
    # still in warmup: the new peak lr times the warmup factor for step 1
    assert learner.optimizer.param_groups[0]["lr"] == 1e-2 * (2 / 11)
    assert learner.algorithm.beta == 0.05
    for p, s in learner.optimizer.state.items():
        assert torch.equal(s["exp_avg"], moments[id(p)])
    learner.scheduler.step()
    assert learner.optimizer.param_groups[0]["lr"] == 1e-2 * (3 / 11)


def test_kl_in_advantage_shapes_each_tokens_advantage_and_adds_no_kl_term(tmp_path):
    """The learner's update with ``kl_in_advantage`` is the gradient of the surrogate over
    KL-shaped advantages, not of the surrogate plus ``beta * kl``."""
    from pbt.algorithms import losses
    from pbt.algorithms.rollout.hf import sequence_logprobs

    beta = 0.5
    manifest = small_manifest(
        tmp_path,
        algorithm={"beta": beta, "kl_in_advantage": True},
        optim={"lr": 5e-2, "max_grad_norm": 0.0},
    )
    member = Member(manifest, CPU)
    learner, model = member.learner, member.model
    batch, _ = _scored_batch(member)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, 0.2, 0.0, 1.0])
    learner.learn(batch, rewards)  # off the reference, so the KL is not zero
    params = [p for p in model.parameters() if p.requires_grad]
    learner.optimizer = torch.optim.SGD(params, lr=1.0)  # the change is minus the gradient
    mask, temperature = batch.completion_mask, learner.rollout_cfg.temperature
    model.train()
    with torch.no_grad(), model.disable_adapter():
        ref = sequence_logprobs(model, batch, temperature)
    logp = sequence_logprobs(model, batch, temperature)
    adv, _ = learner.objective.advantages(rewards, 4, 1e-4)
    kl = losses.kl_k3(logp, ref, mask)
    denominator = losses.aggregation_denominator(mask, "token-mean")

    def gradient(advantages, kl_term):
        per_token, _ = learner.objective.per_token_loss(logp, logp.detach(), advantages, mask,
                                                        0.2, 0.2)  # fmt: skip
        loss = losses.aggregate(per_token + kl_term, mask, "token-mean", denominator)
        return torch.autograd.grad(loss, params, retain_graph=True)

    shaped = gradient(losses.kl_shaped_advantages(adv, kl, mask, beta), 0.0)
    with_term = gradient(adv, beta * kl)
    before = [p.detach().clone() for p in params]
    metrics = learner.learn(batch, rewards)
    assert metrics["kl"] > 0.0
    for old, p, g in zip(before, params, shaped, strict=True):
        torch.testing.assert_close(old - p.detach(), g, rtol=1e-4, atol=1e-7)
    assert any((g - o).abs().max() > 1e-4 for g, o in zip(shaped, with_term, strict=True))
