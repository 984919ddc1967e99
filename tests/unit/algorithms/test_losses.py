"""GRPO's loss pieces against values computed by hand."""

import math

import pytest
import torch

from pbt.algorithms import losses


def test_advantages_normalise_within_each_group_with_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0])
    adv, signal = losses.group_advantages(rewards, group_size=4, eps=1e-4)
    # group 1: mean 0.5, std 0.5  -> +-0.5 / 0.5001
    # group 2: mean 0.75, std sqrt((2.25^2 + 3 * 0.75^2) / 4) = 1.299038...
    g2_std = math.sqrt((2.25**2 + 3 * 0.75**2) / 4)
    expected = [0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001]
    expected += [2.25 / (g2_std + 1e-4)] + [-0.75 / (g2_std + 1e-4)] * 3
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert signal.all()


def test_all_equal_group_has_zero_advantage_and_no_signal():
    rewards = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.0, 0.5])
    adv, signal = losses.group_advantages(rewards, group_size=3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert signal.tolist() == [False, False, False, True, True, True]
    assert adv[3:].sum().item() == pytest.approx(0.0, abs=1e-6)


def test_advantages_reject_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of 4"):
        losses.group_advantages(torch.zeros(6), group_size=4)


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probs 1/4, 3/4
    target = torch.tensor([[1]])
    assert losses.token_logprobs(logits, target).item() == pytest.approx(math.log(0.75))
    # at temperature 2 the logits halve: p = sqrt(3) / (1 + sqrt(3))
    hot = losses.token_logprobs(logits, target, temperature=2.0).item()
    assert hot == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_clipped_surrogate_takes_the_pessimistic_branch():
    ratios = torch.tensor([[1.5, 0.5], [1.5, 0.5]])
    old = torch.zeros(2, 2)
    logp = torch.log(ratios)
    adv = torch.tensor([1.0, -1.0])
    loss, clipped = losses.clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.3)
    # adv +1: ratio 1.5 -> min(1.5, 1.3) = 1.3 (clipped); ratio 0.5 -> min(0.5, 0.8) = 0.5
    # adv -1: ratio 1.5 -> min(-1.5, -1.3) = -1.5;        ratio 0.5 -> min(-0.5, -0.8) = -0.8 (clipped)
    assert loss.flatten().tolist() == pytest.approx([-1.3, -0.5, 1.5, 0.8])
    assert clipped.tolist() == [[True, False], [False, True]]


def test_clipped_branch_has_no_gradient():
    logp = torch.log(torch.tensor([[1.5]])).requires_grad_()
    loss, _ = losses.clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_kl_k3_matches_hand_value_and_is_zero_at_equality():
    logp = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    kl = losses.kl_k3(logp, ref)
    # delta = log(0.25 / 0.5): exp(delta) - delta - 1 = 0.5 + log 2 - 1
    assert kl[0, 0].item() == pytest.approx(0.5 + math.log(2.0) - 1.0)
    assert kl[0, 1].item() == pytest.approx(0.0, abs=1e-7)


def test_token_mean_and_sequence_mean():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token = losses.aggregate(
        per_token, mask, "token-mean", losses.aggregation_denominator(mask, "token-mean")
    )
    seq = losses.aggregate(
        per_token, mask, "sequence-mean", losses.aggregation_denominator(mask, "sequence-mean")
    )
    assert token.item() == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5
    assert seq.item() == pytest.approx((2.0 + 4.0) / 2)  # 3.0


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean"])
def test_micro_batches_with_shared_denominator_sum_to_the_whole(mode):
    gen = torch.Generator().manual_seed(0)
    per_token = torch.rand(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    denom = losses.aggregation_denominator(mask, mode)
    whole = losses.aggregate(per_token, mask, mode, denom)
    parts = sum(
        losses.aggregate(per_token[i : i + 2], mask[i : i + 2], mode, denom) for i in (0, 2, 4)
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_empty_mask_gives_zero_loss_that_still_backpropagates():
    per_token = torch.ones(2, 2, requires_grad=True)
    out = losses.aggregate(per_token, torch.zeros(2, 2), "token-mean", 0.0)
    out.backward()
    assert out.item() == 0.0
