"""GRPO on a LoRA adapter: rollout, group-relative advantages, clipped updates, evaluation.

One training step samples ``prompts_per_step`` prompts, ``group_size`` completions each, scores
them, and runs ``update_epochs`` passes of mini-batch updates (micro-batches accumulate
gradients). The reference policy for the KL term is the same model with its adapter disabled:
no second model is held in memory. See :mod:`pbt.algorithms.losses` for the objective and where
it deviates from the paper.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from pbt.algorithms import losses
from pbt.algorithms.rollout import RolloutBatch, generate, sequence_logprobs
from pbt.algorithms.tasks import Example, RewardFn
from pbt.config import AlgorithmConfig, OptimConfig, RolloutConfig

MUTABLE_HYPERPARAMETERS = ("lr", "beta", "clip_low", "clip_high", "temperature", "max_grad_norm")
"""Hyperparameters a mutation may change between generations without breaking the run."""

ZERO_SIGNAL_HINT = (
    "every group in this batch got identical rewards, so there is nothing to learn from and the "
    "update was skipped. Likely causes: the reward is too coarse (all 0 or all 1; give partial "
    "credit), group_size is too small to see different outcomes (try 8 or 16), or the "
    "temperature is too low for completions to differ (try 0.8 to 1.2)."
)


class GRPO:
    """A GRPO learner over a peft model whose trainable parameters are the adapter.

    Args:
        model: a ``PeftModel`` (adapter trainable, base frozen) on its device.
        tokenizer: the matching tokenizer, with a chat template and a pad token.
        algorithm, optim, rollout: the component configs (copied; mutations change the copies).
        total_steps: training steps planned, for the learning-rate schedule.
        seed: seeds the learner's generator (prompt order and mini-batch shuffles).
    """

    def __init__(
        self,
        model,
        tokenizer,
        algorithm: AlgorithmConfig,
        optim: OptimConfig,
        rollout: RolloutConfig,
        total_steps: int,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.algorithm = AlgorithmConfig(**asdict(algorithm))
        self.optim_cfg = OptimConfig(**asdict(optim))
        self.rollout_cfg = RolloutConfig(**asdict(rollout))
        self.total_steps = total_steps
        self.step = 0
        self.generator = torch.Generator().manual_seed(seed)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=self.optim_cfg.lr,
            betas=tuple(self.optim_cfg.betas),
            eps=self.optim_cfg.eps,
            weight_decay=self.optim_cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        warmup = self.optim_cfg.warmup_steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if self.optim_cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        if self.optim_cfg.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    # -- hyperparameters -------------------------------------------------------------------

    def hyperparameters(self) -> dict[str, float]:
        """Current values of the mutable hyperparameters."""
        return {
            "lr": self.optim_cfg.lr,
            "beta": self.algorithm.beta,
            "clip_low": self.algorithm.clip_low,
            "clip_high": self.algorithm.clip_high,
            "temperature": self.rollout_cfg.temperature,
            "max_grad_norm": self.optim_cfg.max_grad_norm,
        }

    def apply_hyperparameters(self, values: dict[str, float]) -> None:
        """Set hyperparameters in place; a new lr lands in the optimizer and the schedule,
        keeping Adam's moments and the schedule's position."""
        unknown = set(values) - set(MUTABLE_HYPERPARAMETERS)
        if unknown:
            raise ValueError(f"not mutable: {sorted(unknown)}; mutable: {MUTABLE_HYPERPARAMETERS}")
        for key, value in values.items():
            if key in ("lr", "max_grad_norm"):
                setattr(self.optim_cfg, key, float(value))
            elif key == "temperature":
                self.rollout_cfg.temperature = float(value)
            else:
                setattr(self.algorithm, key, float(value))
        if "lr" in values:
            self.scheduler.base_lrs = [self.optim_cfg.lr for _ in self.optimizer.param_groups]
            factor = self._lr_factor(self.scheduler.last_epoch)
            for group in self.optimizer.param_groups:
                group["initial_lr"] = self.optim_cfg.lr
                group["lr"] = self.optim_cfg.lr * factor

    # -- one training step -----------------------------------------------------------------

    def sample_prompts(self, train: list[Example]) -> list[Example]:
        """``prompts_per_step`` distinct training examples, drawn from the learner's generator."""
        count = min(self.algorithm.prompts_per_step, len(train))
        order = torch.randperm(len(train), generator=self.generator)[:count]
        return [train[i] for i in order.tolist()]

    def rollout(self, examples: list[Example], reward_fn: RewardFn) -> tuple[RolloutBatch, Tensor]:
        """Sample ``group_size`` completions per example and score them: ``(batch, rewards [N])``."""
        self.model.eval()
        questions = [ex.question for ex in examples]
        batch = generate(
            self.model,
            self.tokenizer,
            questions,
            self.rollout_cfg,
            repeats=self.algorithm.group_size,
        )
        answers = [ex.answer for ex in examples for _ in range(self.algorithm.group_size)]
        repeated = [q for q in questions for _ in range(self.algorithm.group_size)]
        rewards = [
            float(reward_fn(text, a, q))
            for text, a, q in zip(batch.texts, answers, repeated, strict=True)
        ]
        return batch, torch.tensor(rewards, dtype=torch.float32)

    def train_step(self, train: list[Example], reward_fn: RewardFn) -> dict[str, float]:
        """Sample, score and learn from one batch; returns the step's metrics."""
        start = time.perf_counter()
        batch, rewards = self.rollout(self.sample_prompts(train), reward_fn)
        metrics = self.learn(batch, rewards)
        elapsed = time.perf_counter() - start
        metrics["tokens_per_s"] = float(batch.completion_mask.sum()) / max(elapsed, 1e-9)
        metrics["step_time_s"] = elapsed
        return metrics

    def learn(self, batch: RolloutBatch, rewards: Tensor) -> dict[str, float]:
        """Update the adapter from a scored batch; returns metrics.

        Rows of zero-signal groups are dropped before any forward pass. When no row is left,
        nothing is updated and ``metrics["skipped"]`` is 1.
        """
        algo = self.algorithm
        advantages, has_signal = losses.group_advantages(
            rewards, algo.group_size, algo.advantage_eps
        )
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "zero_signal_fraction": 1.0 - float(has_signal.float().mean()),
            "completion_length": float(batch.completion_mask.sum(dim=1).mean()),
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        rows = has_signal.nonzero().squeeze(1)
        self.step += 1
        if rows.numel() == 0:
            # The schedule follows training steps, skipped ones included; torch warns when a
            # scheduler steps without an optimizer step, which here is intended.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
            return {
                **metrics,
                "skipped": 1.0,
                "loss": 0.0,
                "kl": 0.0,
                "clip_fraction": 0.0,
                "grad_norm": 0.0,
            }
        device = batch.completion_ids.device
        signal = batch.select(rows.to(device))
        update = self._update(signal, advantages[rows].to(device))
        self.scheduler.step()
        return {**metrics, **update, "skipped": 0.0}

    def _update(self, batch: RolloutBatch, advantages: Tensor) -> dict[str, float]:
        algo = self.algorithm
        self.model.train()
        ref_logp = self._reference_logprobs(batch) if algo.beta > 0 else None
        single_pass = algo.update_epochs == 1 and (algo.mini_batch_size or len(batch)) >= len(batch)
        old_logp = None if single_pass else self._logprobs_no_grad(batch)
        totals = {
            "loss": 0.0,
            "kl": 0.0,
            "clipped": 0.0,
            "tokens": 0.0,
            "grad_norm": 0.0,
            "updates": 0,
        }
        mini = algo.mini_batch_size or algo.batch_completions
        for _ in range(algo.update_epochs):
            order = torch.randperm(len(batch), generator=self.generator).to(
                batch.completion_ids.device
            )
            for start in range(0, len(batch), mini):
                rows = order[start : start + mini]
                self._mini_batch_step(batch, advantages, rows, old_logp, ref_logp, totals)
        tokens = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"] / max(totals["updates"], 1),
            "kl": totals["kl"] / tokens,
            "clip_fraction": totals["clipped"] / tokens,
            "grad_norm": totals["grad_norm"] / max(totals["updates"], 1),
            "optimizer_steps": float(totals["updates"]),
        }

    def _mini_batch_step(self, batch, advantages, rows, old_logp, ref_logp, totals) -> None:
        algo = self.algorithm
        mask = batch.completion_mask[rows]
        denominator = losses.aggregation_denominator(mask, algo.loss_aggregation)
        micro = algo.micro_batch_size or len(rows)
        loss_sum = 0.0
        for start in range(0, len(rows), micro):
            idx = rows[start : start + micro]
            part = batch.select(idx)
            logp = sequence_logprobs(self.model, part, self.rollout_cfg.temperature)
            old = logp.detach() if old_logp is None else old_logp[idx]
            per_token, clipped = losses.clipped_surrogate(
                logp, old, advantages[idx], algo.clip_low, algo.clip_high
            )
            m = part.completion_mask
            if ref_logp is not None:
                kl = losses.kl_k3(logp, ref_logp[idx])
                per_token = per_token + algo.beta * kl
                totals["kl"] += float((kl.detach() * m).sum())
            loss = losses.aggregate(per_token, m, algo.loss_aggregation, denominator)
            loss.backward()
            loss_sum += float(loss.detach())
            totals["clipped"] += float((clipped.float() * m).sum())
            totals["tokens"] += float(m.sum())
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.optim_cfg.max_grad_norm if self.optim_cfg.max_grad_norm > 0 else math.inf
        totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals["loss"] += loss_sum
        totals["updates"] += 1

    @torch.no_grad()
    def _logprobs_no_grad(self, batch: RolloutBatch) -> Tensor:
        micro = self.algorithm.micro_batch_size or len(batch)
        parts = [
            sequence_logprobs(
                self.model, batch.select(slice(s, s + micro)), self.rollout_cfg.temperature
            )
            for s in range(0, len(batch), micro)
        ]
        return torch.cat(parts)

    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        with self.model.disable_adapter():
            return self._logprobs_no_grad(batch)

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(
        self,
        examples: list[Example],
        reward_fn: RewardFn,
        temperature: float = 0.0,
        batch_size: int = 64,
    ) -> float:
        """Mean reward on ``examples`` (greedy when ``temperature`` is 0)."""
        self.model.eval()
        total = 0.0
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            batch = generate(
                self.model,
                self.tokenizer,
                [ex.question for ex in chunk],
                self.rollout_cfg,
                greedy=temperature == 0,
                temperature=temperature or None,
            )
            total += sum(
                reward_fn(t, ex.answer, ex.question)
                for t, ex in zip(batch.texts, chunk, strict=True)
            )
        return total / max(len(examples), 1)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, step and the learner's generator (adapter weights apart)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
