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
from torch.distributed.tensor import DTensor

from pbt.algorithms import losses
from pbt.algorithms.rollout import RolloutBatch, generate, sequence_logprobs
from pbt.algorithms.tasks import Example, RewardFn
from pbt.config import MUTABLE_HYPERPARAMETERS, AlgorithmConfig, OptimConfig, RolloutConfig
from pbt.distributed import all_reduce, world_info
from pbt.distributed.fsdp import FSDPConfig, average_gradients, is_sharded, set_gradient_sync
from pbt.distributed.state import (
    OptimizerOffload,
    gather_optimizer,
    load_optimizer,
    trainable_parameters,
)
from pbt.errors import ConfigError

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
        seed: seeds the learner's generator (prompt order and mini-batch shuffles); the same on
            every rank, so all ranks draw the same global batch and take their own share.
        fsdp: the sharding options when ``model`` is sharded with FSDP2, else None.
    """

    name = "GRPO"

    @classmethod
    def population(
        cls,
        size: int,
        *,
        model_name: str | None = None,
        pad_token_id: int | None = None,
        pad_token: str | None = None,
        fsdp_config: Any = None,
        hp_config: dict[str, dict[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        device: str | None = None,
        **init_hp: Any,
    ):
        """A library-mode population of ``size`` members of this algorithm on one shared base.

        ``init_hp`` takes AgileRL's ``INIT_HP`` keys in either case (``lr=1e-4`` or
        ``LR=1e-4``, ``group_size=8``, ``beta=0.01``); ``fsdp_config`` is an ``FSDPConfig``,
        a dict of its fields, or True; ``config`` holds any other manifest sections. Nothing
        is loaded until an agent is first used. See :func:`pbt.populate.create_population`.
        """
        from pbt.populate import create_population

        sections = {name: dict(values) for name, values in (config or {}).items()}
        model = sections.setdefault("model", {})
        for key, value in (("pad_token_id", pad_token_id), ("pad_token", pad_token)):
            if value is not None:
                model[key] = value
        if fsdp_config is not None:
            fsdp = asdict(fsdp_config) if isinstance(fsdp_config, FSDPConfig) else fsdp_config
            sections.setdefault("distributed", {})["fsdp"] = fsdp
        return create_population(
            {key.upper(): value for key, value in init_hp.items()},
            algo=cls.name,
            config=sections,
            population_size=size,
            hp_config=hp_config,
            model_name=model_name,
            device=device,
        )

    def __init__(
        self,
        model,
        tokenizer,
        algorithm: AlgorithmConfig,
        optim: OptimConfig,
        rollout: RolloutConfig,
        total_steps: int,
        seed: int = 0,
        fsdp: FSDPConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.algorithm = AlgorithmConfig(**asdict(algorithm))
        self.optim_cfg = OptimConfig(**asdict(optim))
        self.rollout_cfg = RolloutConfig(**asdict(rollout))
        self.total_steps = total_steps
        self.step = 0
        self.generator = torch.Generator().manual_seed(seed)
        world = world_info()
        self.rank, self.world_size = world.rank, world.world_size
        self.device = next(model.parameters()).device
        self.defer_grad_sync = fsdp.defer_grad_sync if fsdp else False
        self._check_world(self.algorithm)
        self.named_params = trainable_parameters(model)
        params = [p for _, p in self.named_params]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=self.optim_cfg.lr,
            betas=tuple(self.optim_cfg.betas),
            eps=self.optim_cfg.eps,
            weight_decay=self.optim_cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # Adam's moments on the host between steps; on a CPU run there is nothing to offload
        offload = fsdp is not None and fsdp.optim_cpu_offload and self.device.type == "cuda"
        self.offload = OptimizerOffload(self.optimizer, self.device) if offload else None

    def _check_world(self, algo: AlgorithmConfig) -> None:
        """The global batch must split evenly over the member's ranks."""
        problems = []
        mini = algo.mini_batch_size or algo.batch_completions
        for key, value in (("prompts_per_step", algo.prompts_per_step), ("mini_batch_size", mini)):
            if value % self.world_size:
                problems.append(
                    f"algorithm.{key} ({value}) must be divisible by the member's "
                    f"{self.world_size} ranks; use a multiple of {self.world_size}"
                )
        if problems:
            raise ConfigError(problems)

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

    def _section(self, name: str) -> Any:
        """The config holding hyperparameter ``name``."""
        section = MUTABLE_HYPERPARAMETERS[name]
        return {"optim": self.optim_cfg, "algorithm": self.algorithm, "rollout": self.rollout_cfg}[
            section
        ]

    def hyperparameters(self) -> dict[str, float]:
        """Current values of the mutable hyperparameters."""
        return {name: getattr(self._section(name), name) for name in MUTABLE_HYPERPARAMETERS}

    def apply_hyperparameters(self, values: dict[str, float]) -> None:
        """Set hyperparameters in place; a new lr lands in the optimizer and the schedule,
        keeping Adam's moments and the schedule's position."""
        unknown = set(values) - set(MUTABLE_HYPERPARAMETERS)
        if unknown:
            raise ValueError(
                f"not mutable: {sorted(unknown)}; mutable: {list(MUTABLE_HYPERPARAMETERS)}"
            )
        for name, value in values.items():
            setattr(self._section(name), name, float(value))
        if "lr" in values:
            self.scheduler.base_lrs = [self.optim_cfg.lr for _ in self.optimizer.param_groups]
            factor = self._lr_factor(self.scheduler.last_epoch)
            for group in self.optimizer.param_groups:
                group["initial_lr"] = self.optim_cfg.lr
                group["lr"] = self.optim_cfg.lr * factor

    # -- one training step -----------------------------------------------------------------

    def sample_prompts(self, train: list[Example]) -> list[Example]:
        """This rank's share of ``prompts_per_step`` distinct training examples.

        Every rank draws the same global list from the shared generator and keeps a contiguous
        slice, so the global batch does not depend on the world size.
        """
        count = min(self.algorithm.prompts_per_step, len(train))
        order = torch.randperm(len(train), generator=self.generator)[:count].tolist()
        share = count // self.world_size
        return [train[i] for i in order[self.rank * share : (self.rank + 1) * share]]

    def complete(self, questions: list[str], training: bool = True) -> RolloutBatch:
        """Completions for ``questions``: ``group_size`` samples each when ``training``, else one
        greedy completion each. Rows are grouped by question."""
        self.model.eval()
        return generate(
            self.model,
            self.tokenizer,
            questions,
            self.rollout_cfg,
            repeats=self.algorithm.group_size if training else 1,
            greedy=not training,
            synced=is_sharded(self.model),
        )

    def score(self, examples: list[Example], batch: RolloutBatch, reward_fn: RewardFn) -> Tensor:
        """Rewards ``[N]`` of ``batch``'s completions, its rows grouped by ``examples``."""
        repeats = len(batch) // max(len(examples), 1)
        if repeats * len(examples) != len(batch):
            raise ValueError(
                f"a batch of {len(batch)} completions does not group evenly over "
                f"{len(examples)} prompts"
            )
        rewards = [
            float(reward_fn(text, examples[i // repeats].answer, examples[i // repeats].question))
            for i, text in enumerate(batch.texts)
        ]
        return torch.tensor(rewards, dtype=torch.float32)

    def rollout(self, examples: list[Example], reward_fn: RewardFn) -> tuple[RolloutBatch, Tensor]:
        """Sample ``group_size`` completions per example and score them: ``(batch, rewards [N])``."""
        batch = self.complete([ex.question for ex in examples])
        return batch, self.score(examples, batch, reward_fn)

    def train_step(self, train: list[Example], reward_fn: RewardFn) -> dict[str, float]:
        """Sample, score and learn from one batch; returns the step's metrics."""
        start = time.perf_counter()
        batch, rewards = self.rollout(self.sample_prompts(train), reward_fn)
        metrics = self.learn(batch, rewards)
        elapsed = time.perf_counter() - start
        metrics["tokens_per_s"] = float(batch.completion_mask.sum()) / max(elapsed, 1e-9)
        metrics["step_time_s"] = elapsed
        if self.device.type == "cuda":
            metrics["gpu_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def learn(self, batch: RolloutBatch, rewards: Tensor) -> dict[str, float]:
        """Update the adapter from this rank's share of a scored batch; returns global metrics.

        Rows of zero-signal groups are dropped before any forward pass. When no rank has a row
        left, nothing is updated and ``metrics["skipped"]`` is 1. Every rank makes the same
        number of forward passes and optimizer steps, whatever it dropped.
        """
        algo = self.algorithm
        advantages, has_signal = losses.group_advantages(
            rewards, algo.group_size, algo.advantage_eps
        )
        lengths = batch.completion_mask.sum(dim=1).cpu()
        sums = all_reduce(
            [
                float(rewards.sum()),
                float((rewards**2).sum()),
                len(rewards),
                float(has_signal.sum()),
                float(lengths.sum()),
            ]
        )
        count = max(sums[2], 1.0)
        mean = sums[0] / count
        metrics = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(sums[1] / count - mean**2, 0.0)),
            "zero_signal_fraction": 1.0 - sums[3] / count,
            "completion_length": sums[4] / count,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        self.step += 1
        if sums[3] == 0:
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
        rows = has_signal.nonzero().squeeze(1)
        weight = torch.ones(len(batch))
        if rows.numel() == 0:  # other ranks have signal: take part with one zero-weight row
            rows, weight = torch.zeros(1, dtype=torch.long), torch.zeros(len(batch))
        device = batch.completion_ids.device
        signal = batch.select(rows.to(device))
        signal.completion_mask = signal.completion_mask * weight[rows].to(device).unsqueeze(1)
        update = self._update(signal, advantages[rows].to(device))
        self.scheduler.step()
        return {**metrics, **update, "skipped": 0.0}

    def _update(self, batch: RolloutBatch, advantages: Tensor) -> dict[str, float]:
        algo = self.algorithm
        world = self.world_size
        self.model.train()
        ref_logp = self._reference_logprobs(batch) if algo.beta > 0 else None
        mini = (algo.mini_batch_size or algo.batch_completions) // world
        single_pass = algo.update_epochs == 1 and mini >= algo.batch_completions // world
        old_logp = None if single_pass else self._logprobs_no_grad(batch)
        totals = {
            "loss": 0.0,
            "kl": 0.0,
            "clipped": 0.0,
            "tokens": 0.0,
            "grad_norm": 0.0,
            "updates": 0,
        }
        longest = int(all_reduce([len(batch)], "max")[0])
        for _ in range(algo.update_epochs):
            # the same draw on every rank, whatever its row count, keeps the generators in step
            order = torch.randperm(longest, generator=self.generator)
            order = order[order < len(batch)].to(batch.completion_ids.device)
            for start in range(0, longest, mini):
                rows = order[start : start + mini] if start < len(order) else order[:0]
                self._mini_batch_step(batch, advantages, rows, mini, old_logp, ref_logp, totals)
        reduced = all_reduce([totals["kl"], totals["clipped"], totals["tokens"]])
        tokens = max(reduced[2], 1.0)
        return {
            "loss": totals["loss"] / max(totals["updates"], 1),
            "kl": reduced[0] / tokens,
            "clip_fraction": reduced[1] / tokens,
            "grad_norm": totals["grad_norm"] / max(totals["updates"], 1),
            "optimizer_steps": float(totals["updates"]),
        }

    def _mini_batch_step(self, batch, advantages, rows, mini, old_logp, ref_logp, totals) -> None:
        """One optimizer step over ``rows`` (possibly fewer than ``mini``, even none, on this rank)."""
        algo = self.algorithm
        mask = batch.completion_mask[rows]
        local = losses.aggregation_denominator(mask, algo.loss_aggregation) if len(rows) else 0.0
        denominator = all_reduce([local])[0]
        micro = min(algo.micro_batch_size or mini, mini)
        chunks = [rows[s : s + micro] for s in range(0, mini, micro)]
        loss_sum = 0.0
        for i, idx in enumerate(chunks):
            set_gradient_sync(self.model, not self.defer_grad_sync or i == len(chunks) - 1)
            live = len(idx) > 0
            idx = idx if live else torch.zeros(1, dtype=torch.long, device=rows.device)
            part = batch.select(idx)
            m = part.completion_mask * (1.0 if live else 0.0)
            logp = sequence_logprobs(self.model, part, self.rollout_cfg.temperature)
            old = logp.detach() if old_logp is None else old_logp[idx]
            per_token, clipped = losses.clipped_surrogate(
                logp, old, advantages[idx], algo.clip_low, algo.clip_high
            )
            if ref_logp is not None:
                kl = losses.kl_k3(logp, ref_logp[idx])
                per_token = per_token + algo.beta * kl
                totals["kl"] += float((kl.detach() * m).sum())
            # gradients are averaged across ranks: scale by the world size to get their sum
            loss = (
                losses.aggregate(per_token, m, algo.loss_aggregation, denominator) * self.world_size
            )
            loss.backward()
            loss_sum += float(loss.detach()) / self.world_size
            totals["clipped"] += float((clipped.float() * m).sum())
            totals["tokens"] += float(m.sum())
        totals["grad_norm"] += self._optimizer_step()
        totals["loss"] += all_reduce([loss_sum])[0]
        totals["updates"] += 1

    def _optimizer_step(self) -> float:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not is_sharded(self.model):
            average_gradients(params)
        max_norm = self.optim_cfg.max_grad_norm if self.optim_cfg.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self._state_to_device()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._state_to_host()
        return float(norm)

    def _state_to_device(self) -> None:
        if self.offload is not None:
            self.offload.to_device()

    def _state_to_host(self) -> None:
        if self.offload is not None:
            self.offload.to_host()

    @torch.no_grad()
    def _logprobs_no_grad(self, batch: RolloutBatch) -> Tensor:
        micro = self.algorithm.micro_batch_size or len(batch)
        longest = int(all_reduce([len(batch)], "max")[0])
        parts = []
        for start in range(0, longest, micro):
            # ranks with fewer rows still run the forward pass: sharded layers gather together
            rows = slice(start, start + micro) if start < len(batch) else slice(0, 1)
            logp = sequence_logprobs(self.model, batch.select(rows), self.rollout_cfg.temperature)
            if start < len(batch):
                parts.append(logp)
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
        """Mean reward on ``examples`` (greedy when ``temperature`` is 0), split across ranks."""
        self.model.eval()
        mine = examples[self.rank :: self.world_size]
        # every rank runs the same number of generate calls (sharded layers gather together)
        calls = math.ceil(math.ceil(len(examples) / self.world_size) / batch_size)
        total = 0.0
        for call in range(calls):
            chunk = mine[call * batch_size : (call + 1) * batch_size]
            batch = generate(
                self.model,
                self.tokenizer,
                [ex.question for ex in chunk or examples[:1]],
                self.rollout_cfg,
                greedy=temperature == 0,
                temperature=temperature or None,
                synced=is_sharded(self.model),
            )
            total += sum(
                reward_fn(t, ex.answer, ex.question)
                for t, ex in zip(batch.texts, chunk, strict=False)
            )
        return all_reduce([total])[0] / max(len(examples), 1)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (gathered, by parameter name), scheduler, step and generator.

        A collective under FSDP: every rank calls it.
        """
        self._state_to_device()
        optimizer = gather_optimizer(self.named_params, self.optimizer)
        self._state_to_host()
        return {
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, on any world size."""
        load_optimizer(self.named_params, self.optimizer, state["optimizer"])
        self._state_to_host()
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
