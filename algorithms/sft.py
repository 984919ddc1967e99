"""Supervised fine-tuning of the adapter: the masked next-token loss on prompt/response pairs.

Each step takes ``prompts_per_step`` examples (split over the ranks), chat-templates each prompt
as a user turn, and trains on the response tokens and the end-of-turn token only (the prompt is
context, not a target). The loss of a mini-batch is its summed token NLL over its tokens on all
ranks, so micro-batches and world sizes give the same update.

Fitness is the negative mean NLL per response token on the held-out examples: larger is better,
and it does not depend on any hyperparameter a mutation changes, so members stay comparable.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from pbt.algorithms.data.supervised import SFTExample, encode_pairs
from pbt.algorithms.learner import Learner
from pbt.algorithms.preference import sft_loss_terms
from pbt.algorithms.rollout.hf import RolloutBatch, sequence_logprobs
from pbt.algorithms.runtime.models import set_mode
from pbt.distributed import all_reduce


class SFT(Learner):
    """Masked next-token training on prompt/response pairs."""

    name = "SFT"
    fitness_name = "held-out -NLL/token"

    def encode(self, examples: list[SFTExample]) -> RolloutBatch:
        batch = encode_pairs(
            self.tokenizer,
            [ex.chat for ex in examples],
            [ex.response for ex in examples],
            self.rollout_cfg.max_output_tokens,
        )
        return _to(batch, self.device)

    def train_step(self, train: list[SFTExample], reward=None) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.learn(self.sample_prompts(train))
        elapsed = time.perf_counter() - start
        metrics["tokens_per_s"] = metrics["tokens"] / max(elapsed, 1e-9)
        metrics["step_time_s"] = elapsed
        return metrics | self.memory_metrics()

    def learn(self, examples: list[SFTExample]) -> dict[str, float]:
        """One step on this rank's share of a global batch; returns global metrics."""
        set_mode(self.model, True)
        batch = self.encode(examples)

        def loss(idx: Tensor) -> tuple[Tensor, dict[str, float]]:
            part = batch.select(idx)
            total, count = sft_loss_terms(
                sequence_logprobs(self.model, part, 1.0), part.completion_mask
            )
            return total, {"nll": float(total.detach()), "tokens": float(count)}

        def weight(idx: Tensor) -> float:
            return float(batch.completion_mask[idx].sum())

        totals, grad_norm, steps = self._update_in_mini_batches(len(batch), weight, loss)
        nll, tokens = all_reduce([totals["nll"], totals["tokens"]])
        lr = self.optimizer.param_groups[0]["lr"]
        self.step += 1
        self._advance_schedule()
        return {
            "loss": nll / max(tokens, 1.0),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens / self.algorithm.update_epochs,
            "optimizer_steps": float(steps),
            "nonfinite_steps": totals["nonfinite_steps"],
        }

    @torch.no_grad()
    def evaluate(self, examples: list[SFTExample], reward=None, temperature: float = 0.0) -> float:
        """Negative mean NLL per response token over ``examples``, split across ranks."""
        set_mode(self.model, False)
        nll, tokens = _sum_over_chunks(
            self, examples, lambda part: sft_loss_terms(
                sequence_logprobs(self.model, part, 1.0), part.completion_mask
            ),
        )  # fmt: skip
        return -nll / max(tokens, 1.0)

    def describe(self, m: dict[str, float]) -> str:
        return (
            f"nll {m['loss']:.4f}  ppl {math.exp(min(m['loss'], 50.0)):.2f}  "
            f"grad {m['grad_norm']:.3f}  {m.get('tokens_per_s', 0.0):.0f} tok/s"
        )


def _to(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    return RolloutBatch(
        batch.prompt_ids.to(device),
        batch.prompt_mask.to(device),
        batch.completion_ids.to(device),
        batch.completion_mask.to(device),
        batch.texts,
    )


def _sum_over_chunks(
    learner: Learner, examples: list, terms, batch_size: int = 32
) -> tuple[float, float]:
    """Sum ``terms(batch) -> (value, count)`` over ``examples`` split across ranks; every rank
    runs the same number of forward passes (sharded layers gather together)."""
    mine = examples[learner.rank :: learner.world_size]
    calls = math.ceil(math.ceil(len(examples) / learner.world_size) / batch_size)
    value = count = 0.0
    for call in range(calls):
        chunk = mine[call * batch_size : (call + 1) * batch_size]
        part = learner.encode(chunk or examples[:1])
        v, c = terms(part)
        if chunk:
            value, count = value + float(v), count + float(c)
    return tuple(all_reduce([value, count]))
