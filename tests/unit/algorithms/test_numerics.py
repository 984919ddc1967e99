"""Numerical safety: the loss's clamps and dual clip against hand-computed values, garbage at
masked positions, and the learner's handling of non-finite steps (skipped, counted, and N in a
row end the member as ``diverged``, which the campaign retries and then replaces)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support import DRIVERS, small_manifest, write_manifest

from pbt.algorithms import losses
from pbt.algorithms.objectives import OBJECTIVES, get_objective
from pbt.algorithms.runtime.member import Member
from pbt.config.errors import ConfigError, DivergedError
from pbt.config.read.loader import manifest_from_dict
from pbt.controller.campaign import Campaign
from pbt.controller.store import CampaignStore
from pbt.launch.local import LocalLauncher, TaskSpec
from pbt.protocol import faults
from pbt.protocol.messages import TASK_FILE, TaskMessage

CPU = torch.device("cpu")
NAMES = sorted(OBJECTIVES)
RATIO_OBJECTIVES = ["dapo", "dr_grpo", "grpo", "gspo"]
CLIP_LOW, CLIP_HIGH, MAX_TOKENS = 0.2, 0.28, 4
GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 1e4]


def _finite_loss_and_grad(name, logp, old, adv, mask, ref=None, dual_clip=None):
    """The caller's path (objective, optional k3 KL, aggregation): loss and ``logp``'s gradient."""
    logp = logp.clone().requires_grad_()
    objective = get_objective(name)
    per_token, clipped = objective.per_token_loss(
        logp, old, adv, mask, CLIP_LOW, CLIP_HIGH, dual_clip=dual_clip
    )
    if ref is not None:
        per_token = per_token + 0.1 * losses.kl_k3(logp, ref, mask)
    mode = objective.aggregation
    denominator = losses.aggregation_denominator(mask, mode, MAX_TOKENS)
    loss = losses.aggregate(per_token, mask, mode, denominator)
    loss.backward()
    return loss, logp.grad, clipped


def _huge_batch():
    """Log-ratio gaps of ±1e4 on real tokens, and every kind of garbage on the padding."""
    logp = torch.tensor([[-1e4, -0.5, -1.0, 0.0], [-0.1, -1e4, 0.0, 0.0]])
    old = torch.tensor([[-0.5, -1e4, -1.0, 0.0], [-1e4, -0.1, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    garbage = torch.tensor(GARBAGE[:3])
    logp[0, 3], logp[1, 2], logp[1, 3] = garbage
    old[0, 3], old[1, 2], old[1, 3] = garbage.flip(0)
    return logp, old, mask


# -- the clamps: finite whatever the inputs ------------------------------------------------


@pytest.mark.parametrize("advantages", [[1.0, -1.0], [-3.0, 2.0]])
@pytest.mark.parametrize("name", NAMES)
def test_huge_log_ratios_and_masked_garbage_give_a_finite_loss_and_gradient(name, advantages):
    logp, old, mask = _huge_batch()
    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([[1e4, -1e4, 0.0, nan], [1e4, -1e4, inf, -inf]])  # 1e4 away, garbage
    for dual_clip in [None, 3.0] if name in RATIO_OBJECTIVES else [None]:
        loss, grad, _ = _finite_loss_and_grad(
            name, logp, old, torch.tensor(advantages), mask, ref, dual_clip
        )
        assert torch.isfinite(loss), (name, dual_clip, loss)
        assert torch.isfinite(grad).all(), (name, dual_clip, grad)
        # padding has no gradient, whatever it holds
        assert grad[mask == 0].abs().sum() == 0.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_at_masked_positions_changes_neither_loss_nor_gradient(name, garbage):
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3, 5, generator=gen) - 2.0
    logp = old + 0.2 * torch.randn(3, 5, generator=gen)
    ref = old + 0.2 * torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 2 + [0.0] * 3])
    adv = torch.tensor([1.0, -0.5, 2.0])
    clean = _finite_loss_and_grad(name, logp, old, adv, mask, ref)
    dirty = [t.masked_fill(mask == 0, garbage) for t in (logp, old, ref)]
    spoiled = _finite_loss_and_grad(name, dirty[0], dirty[1], adv, mask, dirty[2])
    assert torch.equal(clean[0], spoiled[0])
    assert torch.equal(clean[1], spoiled[1])


def test_kl_k3_and_aggregate_stay_finite_on_huge_gaps_and_masked_garbage():
    # the measured failure: one token 25 nats from the reference gave a k3 of 2.9e10
    logp = torch.tensor([[-25.0, -1.0, 1e30]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0, -1e30]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl = losses.kl_k3(logp, ref)
    assert kl[0, 0].item() == losses.KL_BOUND and kl[0, 1].item() == 0.0
    assert torch.isfinite(kl).all()
    masked = losses.kl_k3(logp, ref, mask)
    assert masked[0, 2].item() == 0.0
    # garbage the per-token loss kept (inf, NaN) at masked positions is selected out
    per_token = torch.stack([kl[0], torch.tensor([1.0, 2.0, float("nan")])])
    per_token = torch.cat([per_token, torch.tensor([[float("inf")] * 3])])
    rows = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    for mode in ("token-mean", "sequence-mean", "fixed-length"):
        denominator = losses.aggregation_denominator(rows, mode, MAX_TOKENS)
        out = losses.aggregate(per_token, rows, mode, denominator)
        out.backward(retain_graph=True)
        assert torch.isfinite(out) and torch.isfinite(logp.grad).all()
    # a token at the KL bound has no KL gradient; one below it keeps k3's
    logp.grad = None
    losses.kl_k3(logp, ref, mask).sum().backward()
    assert logp.grad[0].tolist() == [0.0, 0.0, 0.0]
    near = torch.tensor([[-1.0]], requires_grad=True)
    losses.kl_k3(near, torch.tensor([[0.0]])).sum().backward()
    assert near.grad.item() == pytest.approx(1.0 - math.e)  # d/dlogp (e^(r-l) - (r-l) - 1)


def test_the_log_ratio_bound_is_verls_and_binds_only_past_it():
    assert losses.LOG_RATIO_BOUND == 20.0 and losses.KL_BOUND == 10.0
    logp = torch.tensor([[25.0, -25.0, 19.5]], requires_grad=True)
    old = torch.zeros(1, 3)
    ratio = torch.exp(losses.log_ratio(logp, old))
    assert ratio[0].tolist() == pytest.approx([math.exp(20), math.exp(-20), math.exp(19.5)])
    # a negative advantage takes the unclipped branch: e^20 * |A| at most, no gradient past it
    loss, _ = losses.clipped_surrogate(logp, old, torch.tensor([-1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert loss[0, 0].item() == pytest.approx(math.exp(20))
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 2].item() == pytest.approx(math.exp(19.5))


# -- the dual clip ---------------------------------------------------------------------------


def test_dual_clip_caps_negative_advantages_at_c_times_abs_a_by_hand():
    # ratios and advantages per token; clip range [0.8, 1.2], dual clip c = 3
    ratios = torch.tensor([[5.0, 2.0, 0.5, 5.0, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 1.0, -2.0]])
    ratios[0, 4] = 4.0  # A = -2: unclipped loss 8 > 3 * 2
    logp = torch.log(ratios).requires_grad_()
    loss, clipped = losses.clipped_surrogate(
        logp.reshape(-1, 1), torch.zeros(5, 1), adv.reshape(-1), 0.2, 0.2, dual_clip=3.0
    )
    loss.sum().backward()
    # A=-1, r=5: max(5, 1.2) = 5 -> capped at 3;   A=-1, r=2: 2 < 3, kept (unclipped branch)
    # A=-1, r=0.5: max(0.5, 0.8) = 0.8 (ratio clip); A=+1, r=5: -min(5, 1.2) = -1.2, no cap
    # A=-2, r=4: 8 -> capped at 3 * 2 = 6
    assert loss.flatten().tolist() == pytest.approx([3.0, 2.0, 0.8, -1.2, 6.0])
    assert clipped.flatten().tolist() == [True, False, True, True, True]
    # capped tokens have no gradient; the kept one has d(-A r)/dlogp = -A r = 2
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 2.0, 0.0, 0.0, 0.0])
    # without the dual clip, the same tokens keep their unbounded losses
    plain, _ = losses.clipped_surrogate(
        torch.log(ratios).reshape(-1, 1), torch.zeros(5, 1), adv.reshape(-1), 0.2, 0.2
    )
    assert plain.flatten().tolist() == pytest.approx([5.0, 2.0, 0.8, -1.2, 8.0])


@pytest.mark.parametrize("name", RATIO_OBJECTIVES)
def test_every_ratio_objective_applies_the_dual_clip(name):
    # every token of sequence 0 at ratio 5 (GSPO's sequence ratio is 5 too), A = -1
    logp = torch.log(torch.tensor([[5.0, 5.0], [1.1, 1.1]]))
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 2)
    per_token, clipped = get_objective(name).per_token_loss(
        logp, torch.zeros(2, 2), adv, mask, CLIP_LOW, CLIP_HIGH, dual_clip=3.0
    )
    assert per_token[0].tolist() == pytest.approx([3.0, 3.0])
    assert per_token[1].tolist() == pytest.approx([-1.1, -1.1])
    assert clipped[0].all() and not clipped[1].any()


def test_dual_clip_is_refused_where_it_means_nothing():
    with pytest.raises(ValueError, match="must be > 1"):
        losses.dual_clip_loss(torch.ones(1, 1), -torch.ones(1, 1), 1.0)
    for name in ("cispo", "reinforce", "rloo"):
        with pytest.raises(ValueError, match="no dual clip"):
            get_objective(name).per_token_loss(
                torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), 0.2,
                0.2, dual_clip=3.0,
            )  # fmt: skip


def test_the_new_keys_are_checked_with_key_value_rule_and_fix():
    defaults = manifest_from_dict({}).algorithm
    assert defaults.dual_clip is None and defaults.max_nonfinite_steps == 3
    assert manifest_from_dict({"algorithm": {"dual_clip": 3}}).algorithm.dual_clip == 3.0
    cases = {
        "algorithm.dual_clip (1.0) must be > 1": {"dual_clip": 1.0},
        "algorithm.dual_clip (3.0) has no effect with cispo": {"loss": "cispo", "dual_clip": 3.0},
        "algorithm.dual_clip (3.0) has no effect with REINFORCE": {
            "name": "REINFORCE",
            "dual_clip": 3.0,
        },
        "algorithm.max_nonfinite_steps (0) must be > 0": {"max_nonfinite_steps": 0},
    }
    for message, algorithm in cases.items():
        with pytest.raises(ConfigError) as err:
            manifest_from_dict({"algorithm": algorithm})
        assert message in str(err.value)
    assert manifest_from_dict({"algorithm": {"name": "PPO", "dual_clip": 3.0}})


# -- nothing changes for sane runs -----------------------------------------------------------


def _sane(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(6, 7, generator=gen) - 2.0
    logp = old + 0.3 * torch.randn(6, 7, generator=gen)
    ref = old + 0.3 * torch.randn(6, 7, generator=gen)
    mask = (torch.rand(6, 7, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    adv = torch.randn(6, generator=gen)
    return logp, old, ref, mask, adv


def test_clamped_pieces_equal_the_textbook_formulas_bit_for_bit_on_ordinary_inputs():
    logp, old, ref, mask, adv = _sane()
    a, b = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, clipped = losses.clipped_surrogate(a, old, adv, 0.2, 0.28, mask=mask)
    ratio = torch.exp(b - old)
    textbook = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    real = mask != 0  # masked positions get ratio 1 now, and were never used
    assert torch.equal(loss[real], textbook[real])
    textbook_clipped = ratio.clamp(0.8, 1.28) * adv[:, None] < ratio * adv[:, None]
    assert torch.equal(clipped[real], textbook_clipped[real])
    # unmasked, and with a dual clip that nothing reaches, every position is the textbook's
    unmasked, _ = losses.clipped_surrogate(a, old, adv, 0.2, 0.28, dual_clip=50.0)
    assert torch.equal(unmasked, textbook)
    (loss * mask).sum().backward()
    (textbook * mask).sum().backward()
    assert torch.equal(a.grad, b.grad)
    delta = ref - logp
    assert torch.equal(losses.kl_k3(logp, ref), torch.exp(delta) - delta - 1.0)
    assert torch.equal(losses.kl_k3(logp, ref, mask) * mask, (torch.exp(delta) - delta - 1) * mask)
    per_token = torch.rand(6, 7)
    assert torch.equal(
        losses.aggregate(per_token, mask, "token-mean", 10.0), (per_token * mask).sum() / 10.0
    )
    weight, _ = losses.truncated_importance_weights(logp, old, 2.0)
    assert torch.equal(weight, torch.exp(logp - old).clamp(max=2.0))


@pytest.mark.parametrize("name", NAMES)
def test_every_objective_is_unchanged_by_its_bounds_on_ordinary_inputs(name, monkeypatch):
    logp, old, ref, mask, adv = _sane(1)
    bounded = _finite_loss_and_grad(name, logp, old, adv, mask, ref)
    monkeypatch.setattr(losses, "LOG_RATIO_BOUND", math.inf)
    monkeypatch.setattr(losses, "KL_BOUND", math.inf)
    unbounded = _finite_loss_and_grad(name, logp, old, adv, mask, ref)
    for x, y in zip(bounded, unbounded, strict=True):
        assert torch.equal(x, y)


# -- non-finite steps in the learner ---------------------------------------------------------


def _adapter(member: Member) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in member.model.named_parameters() if p.requires_grad}


def _poison(member: Member, how: str = "loss") -> None:
    """Swap the member's objective for one whose loss and gradient (``loss``), loss value alone
    (``value``) or gradient alone (``gradient``) are NaN."""
    real = member.learner.objective.per_token_loss

    def per_token_loss(logp, *args, **kwargs):
        loss, clipped = real(logp, *args, **kwargs)
        if how == "loss":
            return loss * float("nan"), clipped
        if how == "value":  # the gradient stays finite
            return loss + float("nan"), clipped
        # value unchanged (sqrt(0) = 0), gradient NaN: d sqrt(|x|) at 0 is inf * 0
        return loss + (logp - logp.detach()).abs().sqrt(), clipped

    member.learner.objective = dataclasses.replace(
        member.learner.objective, per_token_loss=per_token_loss
    )


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A tiny member's first rollout and rewards with signal in both groups."""
    member = Member(small_manifest(tmp_path_factory.mktemp("scored")), CPU)
    examples = member.learner.sample_prompts(member.task.train)
    batch, _ = member.learner.rollout(examples, member.task.reward)
    return batch, torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0, 0.3, 0.9, 0.1])


@pytest.mark.parametrize("how", ["loss", "value", "gradient"])
def test_a_non_finite_step_is_skipped_counted_and_leaves_the_adapter(tmp_path, scored, how):
    member = Member(small_manifest(tmp_path), CPU)
    learner = member.learner
    batch, rewards = scored
    before, epoch = _adapter(member), learner.scheduler.last_epoch
    _poison(member, how)
    metrics = learner.learn(batch, rewards)
    assert metrics["nonfinite_steps"] == 1.0 and metrics["optimizer_steps"] == 0.0
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert all(torch.equal(before[k], v) for k, v in _adapter(member).items())
    assert not learner.optimizer.state  # Adam never stepped
    assert all(p.grad is None for _, p in learner.named_params)
    assert learner.scheduler.last_epoch == epoch  # nor the schedule
    assert learner.nonfinite_in_a_row == 1
    assert "1 non-finite step skipped" in learner.describe(metrics | {"tokens_per_s": 1.0})


def test_max_nonfinite_steps_in_a_row_end_the_member_as_diverged(tmp_path, scored):
    member = Member(small_manifest(tmp_path, algorithm={"max_nonfinite_steps": 3}), CPU)
    learner = member.learner
    batch, rewards = scored
    real = learner.objective
    _poison(member)
    learner.learn(batch, rewards)
    learner.learn(batch, rewards)
    learner.objective = real  # a finite step in between resets the count
    before = _adapter(member)
    assert learner.learn(batch, rewards)["nonfinite_steps"] == 0.0
    assert learner.nonfinite_in_a_row == 0
    assert any(not torch.equal(before[k], v) for k, v in _adapter(member).items())
    _poison(member)
    learner.learn(batch, rewards)
    learner.learn(batch, rewards)
    assert learner.nonfinite_steps == 4
    with pytest.raises(DivergedError) as err:
        learner.learn(batch, rewards)
    message = str(err.value)
    assert "3 optimizer steps in a row" in message
    assert "algorithm.max_nonfinite_steps = 3" in message and "optim.lr" in message
    assert faults.classify(err.value) == "diverged"


def test_the_shared_mini_batch_loop_skips_non_finite_steps(tmp_path):
    """SFT and DPO step through ``_update_in_mini_batches``: a NaN loss there is skipped and
    counted, its statistics left out."""
    member = Member(small_manifest(tmp_path), CPU)
    learner = member.learner
    before = _adapter(member)
    param = learner.named_params[0][1]

    def loss(idx):
        return param.sum() * float("nan"), {"examples": float(len(idx))}

    totals, norm, steps = learner._update_in_mini_batches(8, lambda idx: float(len(idx)), loss)
    assert totals == {"nonfinite_steps": 1.0, "examples": 0.0} and steps == 0 and norm == 0.0
    assert all(torch.equal(before[k], v) for k, v in _adapter(member).items())


def test_ppo_skips_a_non_finite_step(tmp_path, scored, monkeypatch):
    ppo = {"name": "PPO", "beta": 0.1, "update_epochs": 1}
    member = Member(small_manifest(tmp_path, algorithm=ppo), CPU)
    before = _adapter(member)
    real = losses.clipped_surrogate

    def nan_surrogate(*args, **kwargs):
        loss, clipped = real(*args, **kwargs)
        return loss * float("nan"), clipped

    monkeypatch.setattr(losses, "clipped_surrogate", nan_surrogate)
    metrics = member.learner.learn(*scored)
    assert metrics["nonfinite_steps"] == 1.0 and metrics["optimizer_steps"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in _adapter(member).items())


# -- diverged, as a fault the campaign handles ------------------------------------------------


def test_faults_classify_a_diverged_member(tmp_path):
    err = DivergedError(3, 3, 12)
    assert faults.classify(err) == "diverged"
    wrapped = RuntimeError("the task failed")
    wrapped.__cause__ = err
    assert faults.classify(wrapped) == "diverged"
    assert faults.classify(RuntimeError("diverged")) is None  # only the project's exception
    assert faults.report(tmp_path, err) == "diverged"
    kind, message = faults.read(tmp_path)
    assert kind == "diverged" and message.startswith("DivergedError: training diverged at step 12")


DIVERGING_MEMBER = """
import runpy, sys
from pathlib import Path
from pbt.config.errors import DivergedError
from pbt.protocol import faults
from pbt.protocol.files import read_json

task_path = Path(sys.argv[-1])
task = read_json(task_path)
plan = read_json(Path(task["campaign_dir"]) / "diverge.json") or {}
counter = task_path.parent / "diverge_attempts"
attempt = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(attempt))
if attempt <= plan.get(task["member_id"], 0):
    err = DivergedError(3, 3, 2)
    faults.report(task_path.parent, err)  # as pbt.worker reports it
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
runpy.run_path(FAKE, run_name="__main__")
"""


def _diverging_member(tmp_path: Path) -> list[str]:
    fake = DRIVERS / "fake_member.py"
    script = tmp_path / "diverging_member.py"
    script.write_text(textwrap.dedent(DIVERGING_MEMBER).replace("FAKE", repr(str(fake)), 1))
    return [sys.executable, str(script)]


def test_the_launcher_reports_a_diverged_member(tmp_path):
    command = _diverging_member(tmp_path)
    (tmp_path / "diverge.json").write_text(json.dumps({"m": 1}))
    task_dir = tmp_path / "tasks" / "m"
    task_dir.mkdir(parents=True)
    TaskMessage(
        campaign_dir=str(tmp_path),
        manifest={},
        manifest_base_dir=str(tmp_path),
        member_id="m",
        generation=0,
        parent_id=None,
        parent_checkpoint=None,
        parent_digest=None,
        hyperparameters={"lr": 1e-3},
        mutation=None,
        steps=1,
        checkpoint="checkpoints/m",
    ).write(task_dir / TASK_FILE)
    launcher = LocalLauncher(command, slots=1, poll_s=0.05)
    (outcome,) = launcher.run([TaskSpec("m", task_dir, tmp_path / "m.log")])
    assert outcome.status == "diverged"
    assert "max_nonfinite_steps" in outcome.detail and "exit code 2" in outcome.detail


def test_a_diverged_member_is_retried_from_its_parent_then_replaced(tmp_path):
    manifest = write_manifest(
        tmp_path / "manifest.yaml",
        {
            "INIT_HP": {"POP_SIZE": 3, "TOURNAMENT_SIZE": 2, "ELITISM": True, "EVO_STEPS": 2},
            "budget": {"generations": 2},
            "launch": {
                "slots": 3,
                "max_attempts": 2,
                "heartbeat_timeout_s": 30,
                "persistent_workers": False,
            },
            "tracking": {"enabled": False},
        },
    )
    directory = tmp_path / "c"
    campaign = Campaign.start(manifest, directory, member_command=_diverging_member(tmp_path))
    # g001-m01 diverges once and recovers on its retry; g001-m02 diverges on both attempts
    (directory / "diverge.json").write_text(json.dumps({"g001-m01": 1, "g001-m02": 2}))
    campaign.say = lambda *_: None
    try:
        summary = campaign.run()
    finally:
        campaign.close()
    assert summary.generations == 2
    with CampaignStore(directory / "store.db") as store:
        recorded = [(f["member_id"], f["attempt"], f["kind"]) for f in store.faults()]
        retried, replaced = store.member("g001-m01"), store.member("g001-m02")
    assert recorded == [
        ("g001-m01", 1, "diverged"),
        ("g001-m02", 1, "diverged"),
        ("g001-m02", 2, "diverged"),
        ("g001-m02", 2, "replaced"),
    ]
    assert retried.status == "done" and retried.attempts == 2
    assert replaced.status == "done" and "replaced by a clone of" in replaced.mutation
