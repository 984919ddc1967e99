"""The GRPO family's objectives against numbers worked out by hand or by a direct formula."""

import math

import pytest
import torch

from pbt.algorithms import losses
from pbt.algorithms.objectives import OBJECTIVES, get_objective
from pbt.algorithms.objectives.dapo import overlong_penalty
from pbt.config import ConfigError, manifest_from_dict

NAMES = ["grpo", "dr_grpo", "dapo", "cispo", "gspo", "reinforce", "rloo"]
CLIP_LOW, CLIP_HIGH, MAX_TOKENS = 0.2, 0.28, 4


def run(name, logp, old, adv, mask, mode=None, max_tokens=MAX_TOKENS):
    """The caller's path: per-token loss, then the objective's aggregation over the batch."""
    objective = get_objective(name)
    mode = mode or objective.aggregation
    per_token, clipped = objective.per_token_loss(logp, old, adv, mask, CLIP_LOW, CLIP_HIGH)
    denominator = losses.aggregation_denominator(mask, mode, max_tokens)
    return losses.aggregate(per_token, mask, mode, denominator), clipped


# -- registry ------------------------------------------------------------------------------


def test_registry_names_and_aggregations():
    assert sorted(OBJECTIVES) == sorted(NAMES)
    assert {n: o.aggregation for n, o in OBJECTIVES.items()} == {
        "grpo": "token-mean",
        "dr_grpo": "fixed-length",
        "dapo": "token-mean",
        "cispo": "token-mean",
        "gspo": "sequence-mean",
        "reinforce": "sequence-mean",
        "rloo": "sequence-mean",
    }
    assert all(get_objective(n).name == n for n in NAMES)


def test_unknown_objective_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        get_objective("grpoo")
    message = str(err.value)
    assert "'grpoo'" in message and "did you mean 'grpo'" in message
    assert "cispo, dapo, dr_grpo, grpo, gspo, reinforce, rloo" in message


# -- advantages ----------------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 3.0, 1.0])  # groups of 2: mean 0.5 std 0.5; mean 2 std 1
STD_NORMALISED = [0.5 / 0.5001, -0.5 / 0.5001, 1.0 / 1.0001, -1.0 / 1.0001]
CENTRED = [0.5, -0.5, 1.0, -1.0]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("grpo", STD_NORMALISED),
        ("dapo", STD_NORMALISED),
        ("cispo", STD_NORMALISED),
        ("gspo", STD_NORMALISED),
        ("dr_grpo", CENTRED),
        ("reinforce", CENTRED),
        ("rloo", [1.0, -1.0, 2.0, -2.0]),  # G / (G - 1) = 2: r_i minus the other reward
    ],
)
def test_advantages_with_or_without_the_std(name, expected):
    adv, signal = get_objective(name).advantages(REWARDS, 2, 1e-4)
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert signal.all()


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    adv, _ = get_objective("rloo").advantages(torch.tensor([1.0, 0.0, 2.0]), 3, 1e-4)
    # 1 - (0 + 2) / 2, 0 - (1 + 2) / 2, 2 - (1 + 0) / 2
    assert adv.tolist() == pytest.approx([0.0, -1.5, 1.5])


def test_rloo_rejects_groups_of_one():
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_objective("rloo").advantages(torch.tensor([1.0, 0.0]), 1, 1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_zero_signal_groups_are_masked(name):
    adv, signal = get_objective(name).advantages(torch.tensor([0.5, 0.5, 1.0, 0.0]), 2, 1e-4)
    assert signal.tolist() == [False, False, True, True]
    assert adv[:2].tolist() == [0.0, 0.0]
    assert adv[2].item() > 0 > adv[3].item()


@pytest.mark.parametrize("name", NAMES)
def test_advantages_reject_a_batch_that_is_not_whole_groups(name):
    with pytest.raises(ValueError, match="multiple of 4"):
        get_objective(name).advantages(torch.zeros(6), 4, 1e-4)


STD_OBJECTIVES = ["grpo", "dapo", "cispo", "gspo"]


@pytest.mark.parametrize("name", STD_OBJECTIVES)
def test_mean_only_drops_the_std_of_the_std_normalised_objectives(name):
    adv, signal = get_objective(name, "mean_only").advantages(REWARDS, 2, 1e-4)
    assert adv.tolist() == pytest.approx(CENTRED, rel=1e-6) and signal.all()
    assert get_objective(name, "mean_only").advantage_norm == "mean_only"
    assert get_objective(name, "mean_std") is get_objective(name) is OBJECTIVES[name]
    zero, signal = get_objective(name, "mean_only").advantages(torch.tensor([2.0, 2.0]), 2, 1e-4)
    assert zero.tolist() == [0.0, 0.0] and not signal.any()


@pytest.mark.parametrize("name", ["dr_grpo", "reinforce", "rloo"])
def test_the_mean_only_objectives_refuse_mean_std(name):
    assert get_objective(name, "mean_only") is OBJECTIVES[name]
    with pytest.raises(ValueError, match=f"'mean_std' contradicts {name}"):
        get_objective(name, "mean_std")


# -- per-token losses: one batch, every objective, numbers by hand ---------------------------

RATIOS = [[1.5, 0.9, 1.2], [0.5, 1.1, 2.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # the last token of row 1 is padding
PROBS = [[0.4 * r for r in row] for row in RATIOS]  # old probability 0.4 everywhere
ADV = [1.0, -1.0]
log = math.log


def batch():
    old = torch.full((2, 3), log(0.4))
    logp = torch.log(torch.tensor(PROBS)).requires_grad_()
    return logp, old, torch.tensor(ADV), torch.tensor(MASK)


# PPO clip in [0.8, 1.28]: A=+1 takes min(r, clip r), A=-1 takes min(-r, -clip r).
# row 0: 1.5 -> 1.28 (clipped, no grad), 0.9, 1.2; row 1: 0.5 -> -0.8 (clipped), -1.1
PPO_TOKENS = -1.28 - 0.9 - 1.2 + 0.8 + 1.1  # -1.48 over 5 tokens
PPO_GRAD = [[0.0, -0.9, -1.2], [0.0, 1.1, 0.0]]  # d(-A r)/dlogp = -A r, before the denominator
S0 = (1.5 * 0.9 * 1.2) ** (1 / 3)  # GSPO: inside [0.8, 1.28], unclipped
S1 = math.sqrt(0.5 * 1.1)  # 0.742 < 0.8 with A = -1: clipped to 0.8
CISPO_W = [[1.28, 0.9, 1.2], [0.8, 1.1, 1.28]]
CISPO_LOSS = (
    -(1.28 * log(0.6) + 0.9 * log(0.36) + 1.2 * log(0.48)) + (0.8 * log(0.2) + 1.1 * log(0.44))
) / 5
PG_LOSS = (-(log(0.6) + log(0.36) + log(0.48)) / 3 + (log(0.2) + log(0.44)) / 2) / 2
PG_GRAD = [[-1 / 6] * 3, [0.25, 0.25, 0.0]]  # -A / length / 2 sequences
T, F = True, False
PPO_CLIPPED = [[T, F, F], [T, F, F]]
NONE_CLIPPED = [[F, F, F], [F, F, F]]

HAND = {
    "grpo": (PPO_TOKENS / 5, [[g / 5 for g in r] for r in PPO_GRAD], PPO_CLIPPED),
    "dapo": (PPO_TOKENS / 5, [[g / 5 for g in r] for r in PPO_GRAD], PPO_CLIPPED),
    # 2 sequences * 4 max tokens
    "dr_grpo": (PPO_TOKENS / 8, [[g / 8 for g in r] for r in PPO_GRAD], PPO_CLIPPED),
    # every token keeps -A * w / 5, clipped ones included; the padded 2.0 counts as clipped
    "cispo": (
        CISPO_LOSS,
        [[-w / 5 for w in CISPO_W[0]], [0.8 / 5, 1.1 / 5, 0.0]],
        [[T, F, F], [T, F, T]],
    ),
    # (-S0 + 0.8) / 2; d(-S0)/dlogp_t = -S0 / 3, over 2 sequences; sequence 1 is clipped
    "gspo": ((-S0 + 0.8) / 2, [[-S0 / 6] * 3, [0.0] * 3], [[F, F, F], [T, T, T]]),
    "reinforce": (PG_LOSS, PG_GRAD, NONE_CLIPPED),
    "rloo": (PG_LOSS, PG_GRAD, NONE_CLIPPED),
}


@pytest.mark.parametrize("name", NAMES)
def test_loss_gradient_and_clipping_by_hand(name):
    expected_loss, expected_grad, expected_clipped = HAND[name]
    logp, old, adv, mask = batch()
    loss, clipped = run(name, logp, old, adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert logp.grad.flatten().tolist() == pytest.approx(
        [g for row in expected_grad for g in row], rel=1e-5, abs=1e-7
    )
    assert clipped.tolist() == expected_clipped


def test_cispo_keeps_the_gradient_that_grpo_clips_away():
    for ratio, a, weight in [(1.5, 1.0, 1.2), (0.5, -1.0, 0.8)]:  # clip range [0.8, 1.2]
        grads = {}
        for name in ("grpo", "cispo"):
            logp = torch.log(torch.tensor([[ratio]])).requires_grad_()
            per_token, clipped = get_objective(name).per_token_loss(
                logp, torch.zeros(1, 1), torch.tensor([a]), torch.ones(1, 1), 0.2, 0.2
            )
            per_token.sum().backward()
            assert clipped.item()
            grads[name] = logp.grad.item()
        assert grads["grpo"] == 0.0
        assert grads["cispo"] == pytest.approx(-a * weight)


def test_gspo_gradient_is_the_sequence_level_objectives():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(6, 5, generator=gen) - 2.0
    start = old + 0.3 * torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])

    logp = start.clone().requires_grad_()
    loss, clipped = run("gspo", logp, old, adv, mask)
    loss.backward()

    direct_logp = start.clone().requires_grad_()
    s = torch.exp(((direct_logp - old) * mask).sum(dim=1) / mask.sum(dim=1))
    objective = torch.minimum(s * adv, torch.clamp(s, 0.8, 1.28) * adv).mean()
    (-objective).backward()

    assert loss.item() == pytest.approx(-objective.item(), rel=1e-6)
    assert torch.allclose(logp.grad, direct_logp.grad, atol=1e-7)
    assert 0 < clipped[:, 0].sum() < 6  # both branches exercised


def test_fixed_length_weighs_every_token_the_same_whatever_the_length():
    # two wrong answers (A = -1), 3 tokens and 1 token, on-policy (ratio 1): loss = sum(mask)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    grads = {}
    for mode in ("fixed-length", "sequence-mean"):
        logp = torch.full((2, 3), -1.0, requires_grad=True)
        loss, _ = run("dr_grpo", logp, logp.detach(), torch.tensor([-1.0, -1.0]), mask, mode)
        loss.backward()
        grads[mode] = logp.grad
    # fixed-length: each token 1 / (2 sequences * 4 max tokens)
    assert grads["fixed-length"].flatten().tolist() == pytest.approx([1 / 8] * 4 + [0.0] * 2)
    # sequence-mean: 1 / (length * 2), the long answer's tokens a third of the short one's
    assert grads["sequence-mean"].flatten().tolist() == pytest.approx([1 / 6] * 3 + [0.5, 0, 0])


def test_fixed_length_denominator():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])  # row 1 masked: not counted
    assert losses.aggregation_denominator(mask, "fixed-length", max_tokens=16) == 32.0
    with pytest.raises(ValueError, match="max_tokens"):
        losses.aggregation_denominator(mask, "fixed-length")


# -- DAPO's overlong penalty ---------------------------------------------------------------


def test_overlong_penalty_at_the_boundaries():
    lengths = torch.tensor([0, 80, 81, 90, 100, 120])  # budget 100, buffer 20: ramp from 80
    assert overlong_penalty(lengths, 100, 20).tolist() == pytest.approx(
        [0.0, 0.0, -0.05, -0.5, -1.0, -1.0]
    )
    assert overlong_penalty(lengths, 100, 20, factor=0.5).tolist() == pytest.approx(
        [0.0, 0.0, -0.025, -0.25, -0.5, -0.5]
    )


@pytest.mark.parametrize("buffer", [0, 101])
def test_overlong_penalty_rejects_a_buffer_outside_the_budget(buffer):
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([10]), 100, buffer)


# -- gradient accumulation -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean", "fixed-length"])
@pytest.mark.parametrize("name", NAMES)
def test_micro_batches_with_the_shared_denominator_give_the_mini_batch(name, mode):
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, 5, generator=gen) - 2.0
    start = old + 0.3 * torch.randn(4, 5, generator=gen)
    mask = (torch.rand(4, 5, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    mask[1, 3:] = 0.0
    adv = torch.tensor([1.0, -1.0, 0.7, -0.7])
    objective = get_objective(name)
    denominator = losses.aggregation_denominator(mask, mode, max_tokens=5)

    def loss_of(logp, rows):
        per_token, _ = objective.per_token_loss(
            logp[rows], old[rows], adv[rows], mask[rows], CLIP_LOW, CLIP_HIGH
        )
        return losses.aggregate(per_token, mask[rows], mode, denominator)

    whole_logp = start.clone().requires_grad_()
    whole = loss_of(whole_logp, slice(0, 4))
    whole.backward()
    parts_logp = start.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part = loss_of(parts_logp, rows)
        part.backward()
        total += part.item()

    assert total == pytest.approx(whole.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(parts_logp.grad, whole_logp.grad, atol=1e-7)
    assert whole_logp.grad.abs().sum() > 0


# -- KL advantage shaping ------------------------------------------------------------------

LN2 = math.log(2.0)


def test_kl_shaping_by_hand_replaces_the_kl_term():
    """Ratio 1 (on-policy), beta 0.1, sequences of 3 and 2 real tokens; the reference is
    ``logp + d`` with d = [0, ln2, -ln2] and [ln2, -ln2, pad]: k3 is 0, 1 - ln2, ln2 - 0.5 and
    each sequence's KL sums to 0.5 (means 1/6 and 1/4)."""
    beta = 0.1
    logp = torch.zeros(2, 3, requires_grad=True)
    ref = torch.tensor([[0.0, LN2, -LN2], [LN2, -LN2, 25.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    k_up, k_down = 1.0 - LN2, LN2 - 0.5
    shaped_by_hand = [
        [1.0 + beta * (1 / 6), 1.0 + beta * (1 / 6 - k_up), 1.0 + beta * (1 / 6 - k_down)],
        [-1.0 + beta * (0.25 - k_up), -1.0 + beta * (0.25 - k_down), -1.0],
    ]
    kl = losses.kl_k3(logp, ref, mask)
    shaped = losses.kl_shaped_advantages(adv, kl, mask, beta)
    assert shaped.tolist() == [pytest.approx(row, rel=1e-6) for row in shaped_by_hand]
    assert not shaped.requires_grad  # the KL is detached: a reward signal, not differentiated

    loss, _ = run("grpo", logp, logp.detach(), shaped, mask)
    loss.backward()
    # -A_t per token over 5 tokens: the shifts sum to 0 in each sequence, so the value is the
    # unshaped surrogate's, -(3 - 2) / 5, with no beta * kl added (that would give -0.18)
    assert loss.item() == pytest.approx(-0.2, rel=1e-6)
    grad_by_hand = [
        [-a / 5 for a in shaped_by_hand[0]],
        [*(-a / 5 for a in shaped_by_hand[1][:2]), 0.0],
    ]
    assert logp.grad.tolist() == [pytest.approx(row, rel=1e-6, abs=1e-9) for row in grad_by_hand]
    assert losses.kl_shaped_advantages(adv, kl, mask, 0.0).tolist() == [[1.0] * 3, [-1.0] * 3]


@pytest.mark.parametrize("name", NAMES)
def test_per_token_advantages_equal_to_the_sequences_give_the_same_loss(name):
    logp, old, adv, mask = batch()
    per_sequence, clipped = run(name, logp, old, adv, mask)
    per_token, clipped_tokens = run(name, logp, old, adv.unsqueeze(1).expand(mask.shape), mask)
    assert per_token.item() == pytest.approx(per_sequence.item(), rel=1e-6)
    assert torch.equal(clipped, clipped_tokens)


# -- the config keys -----------------------------------------------------------------------


def test_advantage_norm_and_kl_in_advantage_config():
    alg = manifest_from_dict({"algorithm": {"loss": "gspo", "advantage_norm": "mean_only"}})
    assert alg.algorithm.advantage_norm == "mean_only" and not alg.algorithm.kl_in_advantage
    assert manifest_from_dict({}).algorithm.advantage_norm is None  # the objective's own
    shaped = manifest_from_dict({"algorithm": {"beta": 0.01, "kl_in_advantage": True}})
    assert shaped.algorithm.kl_in_advantage
    fine = {"loss": "dr_grpo", "advantage_norm": "mean_only"}
    assert manifest_from_dict({"algorithm": fine}).algorithm.advantage_norm == "mean_only"
    refused = {
        "algorithm.advantage_norm ('mean_std') contradicts dr_grpo": {
            "loss": "dr_grpo", "advantage_norm": "mean_std"},
        "algorithm.advantage_norm ('mean_std') contradicts REINFORCE": {
            "name": "REINFORCE", "advantage_norm": "mean_std"},
        "algorithm.advantage_norm ('mean_only') has no effect with PPO": {
            "name": "PPO", "advantage_norm": "mean_only"},
        "algorithm.kl_in_advantage (true) has no effect with PPO": {
            "name": "PPO", "kl_in_advantage": True},
        "algorithm.kl_in_advantage (true) has no effect with DPO": {
            "name": "DPO", "beta": 0.1, "kl_in_advantage": True},
        "algorithm.advantage_norm ('mean') must be one of": {"advantage_norm": "mean"},
    }  # fmt: skip
    for start, section in refused.items():
        with pytest.raises(ConfigError) as err:
            manifest_from_dict({"algorithm": section})
        assert [p for p in err.value.problems if p.startswith(start)], (start, err.value)
