"""Direct preference optimisation of the adapter (Rafailov et al., 2023), sigmoid loss.

Each step takes ``prompts_per_step`` (prompt, chosen, rejected) examples, split over the ranks.
The reference policy is the same model with its adapter disabled, so DPO needs no second
model. See :mod:`pbt.algorithms.preference` for the loss.

Fitness is the held-out preference accuracy (the implicit reward of the chosen response above
the rejected one's), not the reward margin: the margin scales with ``beta``, so after a beta
mutation members with a larger beta would look better without being better.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from pbt.algorithms.data.supervised import PreferenceExample, encode_pairs
from pbt.algorithms.learner import Learner
from pbt.algorithms.preference import dpo_loss, preference_accuracy
from pbt.algorithms.rollout.hf import RolloutBatch, concat_batches, sequence_logprobs
from pbt.algorithms.runtime.models import set_mode
from pbt.algorithms.sft import _sum_over_chunks, _to
from pbt.distributed import all_reduce


class DPO(Learner):
    """Sigmoid DPO against the adapter-disabled reference."""

    name = "DPO"
    fitness_name = "held-out preference accuracy"

    def encode(self, examples: list[PreferenceExample]) -> RolloutBatch:
        """Chosen rows first, then rejected rows, in one batch (one forward pass for both)."""
        prompts = [ex.chat for ex in examples]
        limit = self.rollout_cfg.max_output_tokens
        chosen = encode_pairs(self.tokenizer, prompts, [ex.chosen for ex in examples], limit)
        rejected = encode_pairs(self.tokenizer, prompts, [ex.rejected for ex in examples], limit)
        return _to(concat_batches([chosen, rejected], self.tokenizer.pad_token_id), self.device)

    def _sequence_logps(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """Summed log-probs of the chosen and rejected responses ``([B], [B])``."""
        logp = sequence_logprobs(self.model, batch, 1.0)
        sums = (logp * batch.completion_mask).sum(dim=1)
        half = len(batch) // 2
        return sums[:half], sums[half:]

    @torch.no_grad()
    def _reference(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        with self.model.disable_adapter():
            return self._sequence_logps(batch)

    def train_step(self, train: list[PreferenceExample], reward=None) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.learn(self.sample_prompts(train))
        elapsed = time.perf_counter() - start
        metrics["step_time_s"] = elapsed
        return metrics | self.memory_metrics()

    def learn(self, examples: list[PreferenceExample]) -> dict[str, float]:
        """One step on this rank's share of a global batch; returns global metrics."""
        set_mode(self.model, True)
        beta = self.algorithm.beta

        def loss(idx: Tensor) -> tuple[Tensor, dict[str, float]]:
            batch = self.encode([examples[i] for i in idx.tolist()])
            ref_chosen, ref_rejected = self._reference(batch)
            chosen, rejected = self._sequence_logps(batch)
            losses, margin, accuracy = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)
            stats = {
                "loss": float(losses.detach().sum()),
                "margin": float(margin.sum()),
                "accuracy": float(accuracy.sum()),
                "pairs": float(len(idx)),
            }
            return losses.sum(), stats

        totals, grad_norm, steps = self._update_in_mini_batches(
            len(examples), lambda idx: float(len(idx)), loss
        )
        loss_sum, margin, accuracy, pairs = all_reduce(
            [totals["loss"], totals["margin"], totals["accuracy"], totals["pairs"]]
        )
        pairs = max(pairs, 1.0)
        lr = self.optimizer.param_groups[0]["lr"]
        self.step += 1
        self._advance_schedule()
        return {
            "loss": loss_sum / pairs,
            "reward_margin": margin / pairs,
            "train_accuracy": accuracy / pairs,
            "grad_norm": grad_norm,
            "lr": lr,
            "optimizer_steps": float(steps),
            "nonfinite_steps": totals["nonfinite_steps"],
        }

    @torch.no_grad()
    def evaluate(
        self, examples: list[PreferenceExample], reward=None, temperature: float = 0.0
    ) -> float:
        """Preference accuracy on ``examples``: the share whose chosen response the adapter
        prefers over the rejected one more than the reference does."""
        set_mode(self.model, False)

        def terms(batch: RolloutBatch) -> tuple[float, float]:
            chosen, rejected = self._sequence_logps(batch)
            ref_chosen, ref_rejected = self._reference(batch)
            right = preference_accuracy(chosen, rejected, ref_chosen, ref_rejected)
            return float(right.sum()), float(len(right))

        right, total = _sum_over_chunks(self, examples, terms)
        return right / max(total, 1.0)

    def describe(self, m: dict[str, float]) -> str:
        return (
            f"loss {m['loss']:.4f}  margin {m['reward_margin']:+.3f}  "
            f"train accuracy {m['train_accuracy']:.2f}  grad {m['grad_norm']:.3f}"
        )
