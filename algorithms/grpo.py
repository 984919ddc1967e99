"""GRPO and its family on a LoRA adapter: rollout, group-relative advantages, updates, evaluation.

One training step samples ``prompts_per_step`` prompts, ``group_size`` completions each, scores
them, and runs ``update_epochs`` passes of mini-batch updates (micro-batches accumulate
gradients). ``algorithm.loss`` picks the objective (``grpo``, ``dr_grpo``, ``dapo``, ``cispo``,
``gspo``; see :mod:`pbt.algorithms.objectives`, one module each with where it deviates from its
paper); ``REINFORCE`` is the same machinery with a group-mean or leave-one-out baseline and no
ratio. DAPO's two training-loop pieces are options of every member of the family:
``overlong_buffer`` (a soft penalty for completions that run into the generation budget) and
``dynamic_sampling`` (groups with no reward spread are dropped and more prompts are sampled until
the batch is full). The reference policy for the KL term is the same model with its adapter
disabled: no second model is held in memory. ``kl_in_advantage`` folds that KL into each token's
advantage instead of the loss; ``advantage_norm`` picks the advantages' normalisation.

Numerically, the objectives clamp their log-ratios and keep masked positions out of ``exp``, the
``k3`` KL is clamped (see :mod:`pbt.algorithms.losses`), ``algorithm.dual_clip`` caps
negative-advantage tokens, and an optimizer step whose loss or gradient is still NaN or inf is
skipped and counted in ``nonfinite_steps`` (:class:`~pbt.algorithms.learner.Learner`).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from pbt.algorithms import losses
from pbt.algorithms.data.examples import Chat
from pbt.algorithms.data.rewards import Reward
from pbt.algorithms.data.tasks import Example
from pbt.algorithms.envs.episodes import Episodes, evaluate_episodes, play_batch
from pbt.algorithms.learner import Learner
from pbt.algorithms.objectives import get_objective
from pbt.algorithms.objectives.dapo import overlong_penalty
from pbt.algorithms.passes import Backward, LogProbs, OptimizerStep, Steps, run_alone
from pbt.algorithms.rollout.dedicated import DedicatedRollouts, behaviour_weights
from pbt.algorithms.rollout.hf import RolloutBatch, concat_batches, generate
from pbt.algorithms.runtime.models import set_mode
from pbt.distributed import all_reduce
from pbt.distributed.fsdp import is_sharded, set_gradient_sync

IMPORTANCE_TOTALS = ("is_weight", "is_capped", "logprob_gap", "is_tokens")


class GRPO(Learner):
    """A GRPO-family learner over a peft model whose trainable parameters are the adapter.

    Args: as :class:`~pbt.algorithms.learner.Learner`.
    """

    name = "GRPO"
    fitness_name = "held-out reward"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.objective = get_objective(self.objective_name(), self.algorithm.advantage_norm)
        self.rollouts: DedicatedRollouts | None = None
        """The session with the member's dedicated engine while one samples its training
        batches (:mod:`pbt.algorithms.rollout.dedicated`); None: this process samples."""

    def objective_name(self) -> str:
        return self.algorithm.loss

    def _aggregation(self) -> str:
        """The user's ``loss_aggregation`` for plain GRPO; each variant's own otherwise."""
        if self.objective.name == "grpo":
            return self.algorithm.loss_aggregation
        return self.objective.aggregation

    def describe(self, m: dict[str, float]) -> str:
        return (
            f"reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}  loss {m['loss']:+.4f}  "
            f"kl {m['kl']:.4f}  clip {m['clip_fraction']:.2f}  "
            f"zero-signal {m['zero_signal_fraction']:.2f}  len {m['completion_length']:.1f}  "
            f"{m['tokens_per_s']:.0f} tok/s{nonfinite_note(m)}{engine_note(m)}"
        )

    # -- one training step -----------------------------------------------------------------

    def complete(self, questions: list[Chat], training: bool = True) -> RolloutBatch:
        """Completions for ``questions``: ``group_size`` samples each when ``training``, else one
        greedy completion each. Rows are grouped by question."""
        return self.sample(
            questions,
            repeats=self.algorithm.group_size if training else 1,
            greedy=not training,
        )

    def sample(
        self,
        questions: list[Chat],
        *,
        repeats: int = 1,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> RolloutBatch:
        """Completions from the current adapter through the rollout engine: Hugging Face
        ``generate``, or the process's vLLM engine (the adapter reloaded first if it changed)."""
        set_mode(self.model, False)
        if self.engine is None:
            return generate(
                self.model,
                self.tokenizer,
                questions,
                self.rollout_cfg,
                repeats=repeats,
                greedy=greedy,
                temperature=temperature,
                synced=is_sharded(self.model),
            )
        from pbt.algorithms.rollout.vllm import Request

        if self.adapter_stale:
            self.engine.sync(self)
        return self.engine.complete([Request(self, questions, repeats, greedy, temperature)])[0]

    def score(self, examples: list[Example], batch: RolloutBatch, reward: Reward) -> Tensor:
        """Total rewards ``[N]`` of ``batch``'s completions, its rows grouped by ``examples``."""
        return self.score_terms(examples, batch, reward)[0]

    def score_terms(
        self, examples: list[Example], batch: RolloutBatch, reward: Reward
    ) -> tuple[Tensor, Tensor]:
        """Total rewards ``[N]`` of ``batch``'s completions and each term's raw values
        ``[N, K]`` (``reward.names`` order), its rows grouped by ``examples``."""
        repeats = len(batch) // max(len(examples), 1)
        if repeats * len(examples) != len(batch):
            raise ValueError(
                f"a batch of {len(batch)} completions does not group evenly over "
                f"{len(examples)} prompts"
            )
        rows = [examples[i // repeats] for i in range(len(batch))]
        total, parts = reward(rows, batch.texts)
        terms = torch.stack([parts[name] for name in reward.names], dim=1)  # [N, K]
        return total, terms

    def rollout(self, examples: list[Example], reward: Reward) -> tuple[RolloutBatch, Tensor]:
        """Sample ``group_size`` completions per example and score them: ``(batch, rewards [N])``,
        the rewards shaped by the overlong penalty when ``overlong_buffer`` is set."""
        batch, rewards, _ = self._rollout(examples, reward)
        return batch, rewards

    def _rollout(
        self, examples: list[Example], reward: Reward
    ) -> tuple[RolloutBatch, Tensor, Tensor]:
        """:meth:`rollout`, with each term's raw rewards ``[N, K]`` too; a multi-turn task's
        episodes instead, their returns as rewards (:mod:`pbt.algorithms.envs`)."""
        if isinstance(reward, Episodes):
            return play_batch(self, examples, reward)
        return self.scored(examples, self.complete([ex.chat for ex in examples]), reward)

    def scored(
        self, examples: list[Example], batch: RolloutBatch, reward: Reward
    ) -> tuple[RolloutBatch, Tensor, Tensor]:
        """``batch`` with its total rewards (overlong penalty included) and raw terms."""
        rewards, terms = self.score_terms(examples, batch, reward)
        algo = self.algorithm
        if algo.overlong_buffer > 0:
            lengths = batch.completion_mask.sum(dim=1).cpu()
            rewards = rewards + overlong_penalty(
                lengths, self.rollout_cfg.max_output_tokens, algo.overlong_buffer,
                algo.overlong_penalty,
            )  # fmt: skip
        return batch, rewards, terms

    def train_step(self, train: list[Example], reward: Reward) -> dict[str, float]:
        """Sample, score and learn from one batch; returns the step's metrics, each reward
        term's mean among them as ``reward/<name>``."""
        start = time.perf_counter()
        if self.rollouts is not None:  # a dedicated engine sampled it
            examples, batch, extra = self.rollouts.take(train)
            batch, rewards, terms = self.scored(examples, batch, reward)
        elif self.algorithm.dynamic_sampling:
            batch, rewards, terms, extra = self._dynamic_rollout(train, reward)
        else:
            batch, rewards, terms = self._rollout(self.sample_prompts(train), reward)
            extra = {}
        metrics = self.learn(batch, rewards) | extra
        return self.step_metrics(metrics, reward, terms, batch, start)

    def step_metrics(
        self,
        learned: dict[str, float],
        reward: Reward,
        terms: Tensor,
        batch: RolloutBatch,
        start: float,
    ) -> dict[str, float]:
        """A training step's metrics: what :meth:`learn` returned, each reward term's mean,
        the throughput since ``start`` (``time.perf_counter()``) and the memory peak."""
        metrics = learned | term_means(reward.names, terms)
        if self.rollouts is not None:
            self.rollouts.push(int(metrics.get("optimizer_steps", 0)))
        elapsed = time.perf_counter() - start
        metrics["tokens_per_s"] = float(batch.completion_mask.sum()) / max(elapsed, 1e-9)
        metrics["step_time_s"] = elapsed
        return metrics | self.memory_metrics()

    def plain_step(self, reward: Reward) -> bool:
        """Whether a training step here is: sample prompts (:meth:`sample_prompts`), complete
        them in this process, score (:meth:`scored`), learn (:meth:`learn_steps`): the step a
        population batch runs for several members together. Not with a dedicated or vLLM
        engine, dynamic sampling, a multi-turn task, or an algorithm with its own update."""
        return (
            self.rollouts is None
            and self.engine is None
            and not self.algorithm.dynamic_sampling
            and not isinstance(reward, Episodes)
            and type(self).learn is GRPO.learn
        )

    def _dynamic_rollout(
        self, train: list[Example], reward: Reward
    ) -> tuple[RolloutBatch, Tensor, Tensor, dict[str, float]]:
        """DAPO's dynamic sampling: keep only groups whose rewards differ, and sample more
        prompts until this rank has its share of ``prompts_per_step`` groups, or
        ``max_resamples`` extra rounds have been drawn. Ranks take the same number of rounds.
        """
        algo, group = self.algorithm, self.algorithm.group_size
        want = algo.prompts_per_step // self.world_size
        kept: list[tuple[RolloutBatch, Tensor, Tensor]] = []
        have, rounds, dropped = 0, 0, 0
        while True:
            batch, rewards, terms = self._rollout(self.sample_prompts(train), reward)
            _, signal = self.objective.advantages(rewards, group, algo.advantage_eps)
            groups = signal.view(-1, group)[:, 0].nonzero().squeeze(1)[: want - have]
            dropped += len(signal) // group - len(groups)
            rows = (groups.unsqueeze(1) * group + torch.arange(group)).reshape(-1)
            if len(rows):
                kept.append(
                    (batch.select(rows.to(batch.completion_ids.device)), rewards[rows], terms[rows])
                )
                have += len(groups)
            short = all_reduce([float(have < want)], "max")[0]
            if not short or rounds >= algo.max_resamples:
                break
            rounds += 1
        if not kept:  # nothing with signal on this rank: learn() skips or takes part with zeros
            kept.append((batch, rewards, terms))
        batch = concat_batches([b for b, _, _ in kept], self.tokenizer.pad_token_id)
        rewards = torch.cat([r for _, r, _ in kept])
        terms = torch.cat([t for _, _, t in kept])
        totals = all_reduce([float(rounds), float(dropped)], "max")
        return batch, rewards, terms, {"resample_rounds": totals[0], "dropped_groups": totals[1]}

    def learn(self, batch: RolloutBatch, rewards: Tensor) -> dict[str, float]:
        """Update the adapter from this rank's share of a scored batch; returns global metrics.

        Rows of zero-signal groups are dropped before any forward pass. When no rank has a row
        left, nothing is updated and ``metrics["skipped"]`` is 1. Every rank makes the same
        number of forward passes and optimizer steps, whatever it dropped.
        """
        return run_alone(self, self.learn_steps(batch, rewards))

    def learn_steps(self, batch: RolloutBatch, rewards: Tensor) -> Steps[dict[str, float]]:
        """:meth:`learn` as the passes it asks for (:mod:`pbt.algorithms.passes`): alone, the
        learner answers them itself; in a population batch, with other members' together."""
        algo = self.algorithm
        advantages, has_signal = self.objective.advantages(
            rewards, algo.group_size, algo.advantage_eps
        )
        lengths = batch.completion_mask.sum(dim=1).cpu()
        identical = identical_groups(batch, algo.group_size)
        sums = all_reduce(
            [
                float(rewards.sum()),
                float((rewards**2).sum()),
                len(rewards),
                float(has_signal.sum()),
                float(lengths.sum()),
                float(identical.sum()),
                len(identical),
            ]
        )
        count = max(sums[2], 1.0)
        mean = sums[0] / count
        metrics = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(sums[1] / count - mean**2, 0.0)),
            "zero_signal_fraction": 1.0 - sums[3] / count,
            "completion_length": sums[4] / count,
            "identical_group_fraction": sums[5] / max(sums[6], 1.0),
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        self.step += 1
        self._count_signal(sums[3] == 0)
        if sums[3] == 0:
            self._advance_schedule()  # the schedule follows training steps, skipped ones too
            return {
                **metrics,
                "skipped": 1.0,
                "loss": 0.0,
                "kl": 0.0,
                "clip_fraction": 0.0,
                "grad_norm": 0.0,
                "nonfinite_steps": 0.0,
            }
        rows = has_signal.nonzero().squeeze(1)
        weight = torch.ones(len(batch))
        if rows.numel() == 0:  # other ranks have signal: take part with one zero-weight row
            rows, weight = torch.zeros(1, dtype=torch.long), torch.zeros(len(batch))
        device = batch.completion_ids.device
        signal = batch.select(rows.to(device))
        signal.completion_mask = signal.completion_mask * weight[rows].to(device).unsqueeze(1)
        update = yield from self._update(signal, advantages[rows].to(device))
        self._advance_schedule()
        return {**metrics, **update, "skipped": 0.0}

    def _update(self, batch: RolloutBatch, advantages: Tensor) -> Steps[dict[str, float]]:
        algo = self.algorithm
        world = self.world_size
        set_mode(self.model, True)
        ref_logp = None
        if algo.beta > 0:
            ref_logp = yield from self._logprob_steps(batch, reference=True)
        mini = (algo.mini_batch_size or algo.batch_completions) // world
        single_pass = algo.update_epochs == 1 and mini >= algo.batch_completions // world
        old_logp = None if single_pass else (yield from self._logprob_steps(batch))
        totals = {
            "loss": 0.0,
            "kl": 0.0,
            "clipped": 0.0,
            "tokens": 0.0,
            "grad_norm": 0.0,
            "updates": 0,
            "nonfinite_steps": 0.0,
            **dict.fromkeys(IMPORTANCE_TOTALS, 0.0),
        }
        longest = int(all_reduce([len(batch)], "max")[0])
        for _ in range(algo.update_epochs):
            # the same draw on every rank, whatever its row count, keeps the generators in step
            order = torch.randperm(longest, generator=self.generator)
            order = order[order < len(batch)].to(batch.completion_ids.device)
            for start in range(0, longest, mini):
                rows = order[start : start + mini] if start < len(order) else order[:0]
                yield from self._mini_batch_step(
                    batch, advantages, rows, mini, old_logp, ref_logp, totals
                )
        reduced = all_reduce([totals["kl"], totals["clipped"], totals["tokens"]])
        tokens = max(reduced[2], 1.0)
        return {
            "loss": totals["loss"] / max(totals["updates"], 1),
            "kl": reduced[0] / tokens,
            "clip_fraction": reduced[1] / tokens,
            "grad_norm": totals["grad_norm"] / max(totals["updates"], 1),
            "optimizer_steps": float(totals["updates"]),
            "nonfinite_steps": totals["nonfinite_steps"],
            **self._importance_metrics(batch, totals),
        }

    def _importance_correct(self, per_token, trainer_old, part, mask, totals) -> Tensor:
        """``per_token`` weighted by the truncated importance weight of each token when the
        sampler reported its log-probs (vLLM) and the correction is on, or of each row drawn
        with an older adapter by a dedicated engine; the weights' statistics accumulate in
        ``totals``."""
        if self.rollouts is not None and part.logprobs is not None:
            stale = part.versions < self.rollouts.version
            if not bool(stale.any()):
                return per_token  # drawn with the adapter being trained: weight 1
            weight, capped = behaviour_weights(
                self.objective.name, trainer_old, part.logprobs, stale.to(mask.device), mask,
                self.rollouts.cap,
            )  # fmt: skip
            mask = mask * stale.to(mask.device).unsqueeze(1)
            return self._weighted(per_token, weight, capped, trainer_old, part, mask, totals)
        cap = self.rollout_cfg.vllm.importance_cap
        if part.logprobs is None or cap <= 0:
            return per_token
        weight, capped = losses.truncated_importance_weights(trainer_old, part.logprobs, cap)
        return self._weighted(per_token, weight, capped, trainer_old, part, mask, totals)

    @staticmethod
    def _weighted(per_token, weight, capped, trainer_old, part, mask, totals) -> Tensor:
        """``per_token * weight``, the weights' statistics over ``mask`` added to ``totals``."""
        totals["is_weight"] += float((weight * mask).sum())
        totals["is_capped"] += float((capped.float() * mask).sum())
        totals["logprob_gap"] += float(((trainer_old - part.logprobs).abs() * mask).sum())
        totals["is_tokens"] += float(mask.sum())
        return per_token * weight

    def _importance_metrics(self, batch: RolloutBatch, totals) -> dict[str, float]:
        """The importance correction's global statistics (a collective), when it ran."""
        dedicated = self.rollouts is not None
        if batch.logprobs is None or (not dedicated and self.rollout_cfg.vllm.importance_cap <= 0):
            return {}
        weight, capped, gap, tokens = all_reduce([totals[k] for k in IMPORTANCE_TOTALS])
        tokens = max(tokens, 1.0)
        return {
            "is_weight_mean": weight / tokens,
            "is_capped_fraction": capped / tokens,
            "logprob_gap": gap / tokens,
        }

    def _mini_batch_step(
        self, batch, advantages, rows, mini, old_logp, ref_logp, totals
    ) -> Steps[None]:
        """One optimizer step over ``rows`` (possibly fewer than ``mini``, even none, on this
        rank); a step skipped as non-finite is counted, and its statistics left out."""
        algo = self.algorithm
        mask = batch.completion_mask[rows]
        mode = self._aggregation()
        max_tokens = self.rollout_cfg.max_output_tokens
        local = losses.aggregation_denominator(mask, mode, max_tokens) if len(rows) else 0.0
        denominator = all_reduce([local])[0]
        micro = min(algo.micro_batch_size or mini, mini)
        chunks = [rows[s : s + micro] for s in range(0, mini, micro)]
        loss_sum = 0.0
        step = dict.fromkeys(("kl", "clipped", "tokens", *IMPORTANCE_TOTALS), 0.0)
        for i, idx in enumerate(chunks):
            set_gradient_sync(self.model, not self.defer_grad_sync or i == len(chunks) - 1)
            live = len(idx) > 0
            idx = idx if live else torch.zeros(1, dtype=torch.long, device=rows.device)
            part = batch.select(idx)
            m = part.completion_mask * (1.0 if live else 0.0)
            logp = yield LogProbs(part, self.rollout_cfg.temperature, grad=True)
            old = logp.detach() if old_logp is None else old_logp[idx]
            kl = None if ref_logp is None else losses.kl_k3(logp, ref_logp[idx], m)
            adv = advantages[idx]
            if kl is not None and algo.kl_in_advantage:  # the KL shapes advantages, no loss term
                adv = losses.kl_shaped_advantages(adv, kl, m, algo.beta)
            per_token, clipped = self.objective.per_token_loss(
                logp, old, adv, m, algo.clip_low, algo.clip_high, dual_clip=algo.dual_clip
            )
            per_token = self._importance_correct(per_token, old, part, m, step)
            if kl is not None:
                if not algo.kl_in_advantage:
                    per_token = per_token + algo.beta * kl
                step["kl"] += float((kl.detach() * m).sum())
            # gradients are averaged across ranks: scale by the world size to get their sum
            loss = losses.aggregate(per_token, m, mode, denominator) * self.world_size
            yield Backward(loss)
            loss_sum += float(loss.detach()) / self.world_size
            step["clipped"] += float((clipped.float() * m).sum())
            step["tokens"] += float(m.sum())
        norm = yield OptimizerStep(loss_sum)  # every rank skips, or none does
        if norm is None:
            totals["nonfinite_steps"] += 1.0
            return
        for key, value in step.items():
            totals[key] += value
        totals["grad_norm"] += norm
        totals["loss"] += all_reduce([loss_sum])[0]
        totals["updates"] += 1

    def _logprobs_no_grad(self, batch: RolloutBatch) -> Tensor:
        return run_alone(self, self._logprob_steps(batch))

    def _logprob_steps(self, batch: RolloutBatch, reference: bool = False) -> Steps[Tensor]:
        """Log-probs ``[N, C]`` of the batch's completions without gradients, a micro-batch a
        pass; through the reference policy (the adapter disabled) when ``reference``."""
        micro = self.algorithm.micro_batch_size or len(batch)
        longest = int(all_reduce([len(batch)], "max")[0])
        parts = []
        temperature = self.rollout_cfg.temperature
        for start in range(0, longest, micro):
            # ranks with fewer rows still run the forward pass: sharded layers gather together
            rows = slice(start, start + micro) if start < len(batch) else slice(0, 1)
            logp = yield LogProbs(batch.select(rows), temperature, grad=False, reference=reference)
            if start < len(batch):
                parts.append(logp)
        return torch.cat(parts)

    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        return run_alone(self, self._logprob_steps(batch, reference=True))

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(
        self,
        examples: list[Example],
        reward: Reward,
        temperature: float = 0.0,
        batch_size: int = 64,
    ) -> float:
        """Mean total reward on ``examples`` (greedy when ``temperature`` is 0), split across
        ranks."""
        if isinstance(reward, Episodes):
            return evaluate_episodes(self, examples, reward, temperature, batch_size)
        set_mode(self.model, False)
        mine = examples[self.rank :: self.world_size]
        # every rank runs the same number of generate calls (sharded layers gather together)
        calls = math.ceil(math.ceil(len(examples) / self.world_size) / batch_size)
        total = 0.0
        for call in range(calls):
            chunk = mine[call * batch_size : (call + 1) * batch_size]
            batch = self.sample(
                [ex.chat for ex in chunk or examples[:1]],
                greedy=temperature == 0,
                temperature=temperature or None,
            )
            if chunk:
                total += float(reward(chunk, batch.texts)[0].sum())
        return all_reduce([total])[0] / max(len(examples), 1)


def term_means(names: list[str], terms: Tensor) -> dict[str, float]:
    """Each reward term's mean over every rank's rows, as ``{"reward/<name>": mean}``; a
    collective. ``terms`` is ``[N, K]`` in ``names`` order."""
    sums = all_reduce([*terms.sum(dim=0).tolist(), float(len(terms))])
    count = max(sums[-1], 1.0)
    return {f"reward/{name}": value / count for name, value in zip(names, sums, strict=False)}


def engine_note(metrics: dict[str, float]) -> str:
    """``"  engine v12, 1 behind, 8 stale rows dropped"`` for a progress line when a dedicated
    engine sampled the step, or nothing."""
    if "engine_version" not in metrics:
        return ""
    dropped = metrics.get("stale_dropped", 0.0)
    note = f"  engine v{metrics['engine_version']:.0f}, {metrics['rollout_staleness']:.0f} behind"
    return note + (f", {dropped:.0f} stale rows dropped" if dropped else "")


def identical_groups(batch: RolloutBatch, group_size: int) -> Tensor:
    """``[N / group_size]`` bool: whether every completion of each group is the same token
    sequence (padding after the end ignored), the mark of a collapsed policy."""
    ids = batch.completion_ids.masked_fill(batch.completion_mask == 0, -1).cpu()
    groups = ids.view(-1, group_size, ids.shape[-1])  # [G, group_size, C]
    return (groups == groups[:, :1]).all(dim=2).all(dim=1)


def nonfinite_note(metrics: dict[str, float]) -> str:
    """``"  N non-finite steps skipped"`` for a progress line, or nothing."""
    count = metrics.get("nonfinite_steps", 0.0)
    return f"  {count:.0f} non-finite step{'s' if count != 1 else ''} skipped" if count else ""


class REINFORCE(GRPO):
    """LLM REINFORCE: the policy gradient with a group-mean (or leave-one-out, RLOO) baseline,
    on-policy: one update per batch, no importance ratio, no clipping."""

    name = "REINFORCE"

    def objective_name(self) -> str:
        return "rloo" if self.algorithm.baseline == "rloo" else "reinforce"
