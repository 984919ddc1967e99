"""LLM PPO on a LoRA adapter, with a critic that shares the frozen base: rollout, GAE, updates.

One training step samples ``prompts_per_step`` prompts, ``group_size`` completions each (as GRPO,
so batches stay comparable across the family), scores them, and computes once, before any
update: the policy's log-probs (``default`` adapter), the reference's (adapters disabled, only
when ``beta > 0``) and the critic's values (``value`` adapter and value head). Each completion
token gets the reward ``-beta * kl`` and the last one also the sequence reward; GAE(``gamma``,
``lam``) gives advantages, and returns are advantages + values. Advantages are whitened over the
whole global batch. ``update_epochs`` passes of mini-batch updates follow, micro-batches
accumulating gradients, each minimising the clipped surrogate plus ``vf_coef`` times the clipped
value loss.

Where this deviates from the usual LLM PPO recipes (InstructGPT, TRL's ``PPOTrainer``):

- The critic is not a second model: it is the same frozen base with its own LoRA adapter
  (``value``) and a linear value head on the final hidden state, so a member holds one base
  model. Policy and critic still share no trainable weights; they cost two forward passes.
- The reference policy is the same model with its adapters disabled, as in our GRPO.
- The KL penalty in the reward is ``k1`` (``logp - ref_logp`` of the sampled token, as TRL and
  InstructGPT); no adaptive KL controller: ``beta`` is fixed within a generation (PBT mutates it).
- Several completions per prompt (``group_size``) rather than one; the critic, not the group,
  gives the baseline, so no group is ever dropped for lack of reward spread.
- Whitening covers advantages only (not rewards), over every completion token of the global
  batch; the value loss is aggregated like the policy loss (``loss_aggregation``).
- The policy's log-ratio is clamped to ``±20`` and zeroed at padding before ``exp``, and
  ``dual_clip`` (off by default) caps a negative-advantage token's loss at ``dual_clip * |A|``,
  as in verl (:func:`pbt.algorithms.losses.clipped_surrogate`); an optimizer step whose loss or
  gradient is NaN or inf is skipped and counted in ``nonfinite_steps``.

No torch.distributed here: reductions across ranks go through :func:`pbt.distributed.all_reduce`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from pbt.algorithms import losses
from pbt.algorithms.grpo import GRPO, IMPORTANCE_TOTALS, nonfinite_note
from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
from pbt.algorithms.runtime.models import lora_config, set_mode
from pbt.config import LoRAConfig
from pbt.distributed import all_reduce
from pbt.distributed.fsdp import set_gradient_sync

POLICY_ADAPTER = "default"
VALUE_ADAPTER = "value"
VALUE_HEAD = "value_head"
VALUE_HEAD_INIT_STD = 0.01
"""Small rather than zero: a zero head would give the value adapter no gradient at first."""


# -- pure tensor functions -----------------------------------------------------------------


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over completion tokens.

    Args:
        rewards: ``[N, T]`` per-token rewards.
        values: ``[N, T]`` the critic's value of the state before each token.
        mask: ``[N, T]`` 1.0 on real tokens (a prefix of each row), 0.0 after.
        gamma: discount per token.
        lam: GAE's lambda.

    Returns:
        ``(advantages [N, T], returns [N, T])``, zero where ``mask`` is 0; the value after a
        row's last real token is 0 (the episode ends there).
    """
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [N]
    for t in reversed(range(rewards.shape[1])):
        if t + 1 < rewards.shape[1]:
            next_mask, next_value = mask[:, t + 1], values[:, t + 1]
        else:
            next_mask, next_value = torch.zeros_like(running), torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value * next_mask - values[:, t]
        running = (delta + gamma * lam * next_mask * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token: ``max((v - R)^2, (clip(v, v_old ± clip) - R)^2) / 2``.

    Args:
        values: ``[N, T]`` current values (with grad).
        old_values: ``[N, T]`` values at rollout time.
        returns: ``[N, T]`` the GAE returns.
        clip: how far a new value may move from the old one.

    Returns:
        ``(loss [N, T], clipped [N, T] bool)``; ``clipped`` marks tokens where the clipped
        branch is the larger one.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None, beta: float) -> Tensor:
    """Per-token rewards ``[N, T]``: ``-beta * kl`` on every real token, plus the sequence
    reward ``rewards [N]`` on each row's last real token."""
    out = torch.zeros_like(mask) if kl is None else -beta * kl * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)  # [N]
    out[torch.arange(len(out), device=out.device), last] += rewards.to(out)
    return out


# -- the critic on the model ---------------------------------------------------------------


@contextmanager
def keep_trainable(model: nn.Module) -> Iterator[None]:
    """Restore ``requires_grad`` on every trainable parameter after the block.

    peft 0.21's ``set_adapter`` freezes the adapters it deactivates, and leaving
    ``disable_adapter`` re-activates only the active adapter; the learner's optimizer covers
    both adapters and the head, so all must stay trainable.
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        _make_trainable(trainable)


@contextmanager
def active_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Forward passes inside the block go through adapter ``name``; the policy's after it.
    Every trainable parameter stays trainable throughout."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.set_adapter(name)
    _make_trainable(trainable)
    try:
        yield
    finally:
        model.set_adapter(POLICY_ADAPTER)
        _make_trainable(trainable)


def _make_trainable(params: list[nn.Parameter]) -> None:
    for p in params:
        p.requires_grad_(True)


def token_values(model: nn.Module, batch: RolloutBatch) -> Tensor:
    """The value head on the final hidden state: ``[N, C]`` values of the state before each
    completion token, under whichever adapter is active.

    A forward hook swaps the output layer's result for the value head's, so the values leave
    the root module as its ``logits``: under FSDP2 the head (sharded with the root) is gathered
    during the root's forward, and gathered again before the backward that reaches it, which a
    tensor smuggled out of the forward would miss.
    """
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)

    def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        head = getattr(model, VALUE_HEAD)
        return head(args[0].to(head.weight.dtype))  # [N, P + C, 1]

    output_layer = model.get_base_model().get_output_embeddings()
    handle = output_layer.register_forward_hook(hook)
    try:
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions)
    finally:
        handle.remove()
    prompt_len = batch.prompt_ids.shape[1]
    # as with logits, the state at position t is the one before token t + 1
    return out.logits[:, prompt_len - 1 : -1, 0].float()


class PPO(GRPO):
    """LLM PPO: a clipped policy update against a learned critic (its own adapter and a value
    head on the shared frozen base). Fitness is the mean held-out reward, as GRPO's.

    Args: as :class:`~pbt.algorithms.learner.Learner`; the model must have been through
    :meth:`prepare_model`.
    """

    name = "PPO"

    @classmethod
    def prepare_model(cls, model, lora: LoRAConfig) -> None:
        """Add the critic: a ``value`` LoRA adapter (same config as the policy's) and a value
        head, both trainable; the policy adapter stays the active one."""
        with keep_trainable(model):
            model.add_adapter(VALUE_ADAPTER, lora_config(lora))
        base = model.get_base_model()
        reference = next(base.parameters())
        head = nn.Linear(
            base.config.get_text_config().hidden_size, 1, device=reference.device,
            dtype=reference.dtype,
        )  # fmt: skip
        nn.init.normal_(head.weight, std=VALUE_HEAD_INIT_STD)
        nn.init.zeros_(head.bias)
        setattr(model, VALUE_HEAD, head)
        model.set_adapter(POLICY_ADAPTER)
        for name, p in model.named_parameters():
            if ".lora_" in name or name.startswith(f"{VALUE_HEAD}."):
                p.requires_grad_(True)

    def describe(self, m: dict[str, float]) -> str:
        return (
            f"reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}  loss {m['loss']:+.4f}  "
            f"vloss {m['value_loss']:.4f}  kl {m['kl']:.4f}  clip {m['clip_fraction']:.2f}  "
            f"vclip {m['value_clip_fraction']:.2f}  ev {m['explained_variance']:+.2f}  "
            f"len {m['completion_length']:.1f}  {m['tokens_per_s']:.0f} tok/s{nonfinite_note(m)}"
        )

    # -- one update ------------------------------------------------------------------------

    def learn(self, batch: RolloutBatch, rewards: Tensor) -> dict[str, float]:
        """Update policy and critic from this rank's share of a scored batch; returns global
        metrics. Every rank has the same rows, forward passes and optimizer steps."""
        algo = self.algorithm
        lengths = batch.completion_mask.sum(dim=1).cpu()
        sums = all_reduce(
            [float(rewards.sum()), float((rewards**2).sum()), len(rewards), float(lengths.sum())]
        )
        count = max(sums[2], 1.0)
        mean = sums[0] / count
        metrics = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(sums[1] / count - mean**2, 0.0)),
            "completion_length": sums[3] / count,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        self.step += 1
        set_mode(self.model, True)
        mask = batch.completion_mask  # [N, C]
        old_logp = self._logprobs_no_grad(batch)
        kl = None
        if algo.beta > 0:
            kl = (old_logp - self._reference_logprobs(batch)) * mask  # k1, [N, C]
        old_values = self._values_no_grad(batch)
        rewards = token_rewards(rewards.to(mask.device), mask, kl, algo.beta)
        advantages, returns = gae(rewards, old_values, mask, algo.gamma, algo.lam)
        advantages = _whiten(advantages, mask)
        update = self._ppo_update(batch, advantages, returns, old_logp, old_values)
        self._advance_schedule()
        tokens, kl_sum = all_reduce([float(mask.sum()), float(kl.sum()) if kl is not None else 0.0])
        return {
            **metrics,
            **update,
            "kl": kl_sum / max(tokens, 1.0),
            "explained_variance": _explained_variance(old_values, returns, mask),
        }

    def _ppo_update(self, batch, advantages, returns, old_logp, old_values) -> dict[str, float]:
        algo = self.algorithm
        mini = (algo.mini_batch_size or algo.batch_completions) // self.world_size
        micro = min(algo.micro_batch_size or mini, mini)
        names = ("policy_loss", "value_loss", "clipped", "value_clipped", "tokens")
        totals = dict.fromkeys(names + IMPORTANCE_TOTALS, 0.0)
        norms, steps, nonfinite = 0.0, 0, 0
        for _ in range(algo.update_epochs):
            order = torch.randperm(len(batch), generator=self.generator)
            order = order.to(batch.completion_ids.device)
            for start in range(0, len(batch), mini):
                rows = order[start : start + mini]
                local = losses.aggregation_denominator(
                    batch.completion_mask[rows], algo.loss_aggregation
                )
                denominator = all_reduce([local])[0]
                chunks = [rows[s : s + micro] for s in range(0, len(rows), micro)]
                step, step_loss = dict.fromkeys(totals, 0.0), 0.0
                for i, idx in enumerate(chunks):
                    parts = (advantages[idx], returns[idx], old_logp[idx], old_values[idx])
                    last = i == len(chunks) - 1
                    step_loss += self._micro_step(
                        batch.select(idx), *parts, denominator, last, step
                    )
                norm = self._optimizer_step(step_loss)  # every rank skips, or none does
                if norm is None:
                    nonfinite += 1
                    continue
                for key, value in step.items():
                    totals[key] += value
                norms += norm
                steps += 1
        reduced = dict(zip(names, all_reduce([totals[n] for n in names]), strict=True))
        tokens = max(reduced["tokens"], 1.0)
        policy = reduced["policy_loss"] / max(steps, 1)
        value = reduced["value_loss"] / max(steps, 1)
        return {
            "loss": policy + algo.vf_coef * value,
            "policy_loss": policy,
            "value_loss": value,
            "clip_fraction": reduced["clipped"] / tokens,
            "value_clip_fraction": reduced["value_clipped"] / tokens,
            "grad_norm": norms / max(steps, 1),
            "optimizer_steps": float(steps),
            "nonfinite_steps": float(nonfinite),
            **self._importance_metrics(batch, totals),
        }

    def _micro_step(
        self, part, advantages, returns, old_logp, old_values, denominator, last, totals
    ) -> float:
        """Policy forward and backward, then critic forward and backward, on one micro-batch;
        gradients reduce (FSDP, ``defer_grad_sync``) only after the last backward of a step.
        Returns this rank's loss of the micro-batch (policy + ``vf_coef`` * value)."""
        algo, mask = self.algorithm, part.completion_mask
        mode, scale = algo.loss_aggregation, float(self.world_size)
        set_gradient_sync(self.model, not self.defer_grad_sync)
        logp = sequence_logprobs(self.model, part, self.rollout_cfg.temperature)  # [n, C]
        flat_loss, flat_clipped = losses.clipped_surrogate(
            logp.reshape(-1, 1), old_logp.reshape(-1, 1), advantages.reshape(-1),
            algo.clip_low, algo.clip_high, mask=mask.reshape(-1, 1), dual_clip=algo.dual_clip,
        )  # fmt: skip
        per_token = self._importance_correct(flat_loss.view_as(logp), old_logp, part, mask, totals)
        policy = losses.aggregate(per_token, mask, mode, denominator)
        # gradients are averaged across ranks: scale by the world size to get their sum
        (policy * scale).backward()
        with active_adapter(self.model, VALUE_ADAPTER):
            set_gradient_sync(self.model, not self.defer_grad_sync or last)
            values = token_values(self.model, part)
            per_token, value_clipped = clipped_value_loss(
                values, old_values, returns, algo.value_clip
            )
            value = losses.aggregate(per_token, mask, mode, denominator)
            (algo.vf_coef * value * scale).backward()
        totals["policy_loss"] += float(policy.detach())
        totals["value_loss"] += float(value.detach())
        totals["clipped"] += float((flat_clipped.view_as(logp).float() * mask).sum())
        totals["value_clipped"] += float((value_clipped.float() * mask).sum())
        totals["tokens"] += float(mask.sum())
        return float(policy.detach()) + algo.vf_coef * float(value.detach())

    # -- passes without gradients ----------------------------------------------------------

    @torch.no_grad()
    def _values_no_grad(self, batch: RolloutBatch) -> Tensor:
        """The critic's values ``[N, C]`` at rollout time, in micro-batches."""
        micro = self.algorithm.micro_batch_size or len(batch)
        with active_adapter(self.model, VALUE_ADAPTER):
            parts = [
                token_values(self.model, batch.select(slice(s, s + micro)))
                for s in range(0, len(batch), micro)
            ]
        return torch.cat(parts)

    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        with keep_trainable(self.model):
            return super()._reference_logprobs(batch)


def _whiten(advantages: Tensor, mask: Tensor) -> Tensor:
    """Advantages shifted and scaled to mean 0, variance 1 over every real token of the global
    batch (a collective)."""
    s, s2, n = all_reduce(
        [float((advantages * mask).sum()), float((advantages**2 * mask).sum()), float(mask.sum())]
    )
    n = max(n, 1.0)
    mean = s / n
    var = max(s2 / n - mean**2, 0.0)
    return (advantages - mean) / math.sqrt(var + 1e-8) * mask


def _explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the global batch's real tokens."""
    residual = returns - values
    sums = all_reduce(
        [
            float((returns * mask).sum()),
            float((returns**2 * mask).sum()),
            float((residual * mask).sum()),
            float((residual**2 * mask).sum()),
            float(mask.sum()),
        ]
    )
    n = max(sums[4], 1.0)
    var_returns = sums[1] / n - (sums[0] / n) ** 2
    var_residual = sums[3] / n - (sums[2] / n) ** 2
    return 1.0 - var_residual / var_returns if var_returns > 1e-12 else float("nan")
