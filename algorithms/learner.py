"""What every algorithm's learner shares: the optimizer over the adapter, its learning-rate
schedule, mutable hyperparameters, one exact optimizer step across ranks, and state that
gathers into a checkpoint.

The optimizer step is where non-finite training is caught, once for every algorithm: a step
whose loss (on any rank) or gradient is NaN or inf is skipped on every rank alike (the ranks
agree through one all-reduce of a flag), its gradients are zeroed, the optimizer does not step,
and the learning-rate schedule does not advance for a training step whose every update was
skipped. ``algorithm.max_nonfinite_steps`` skipped steps in a row raise
:class:`~pbt.config.errors.DivergedError`, which the member reports as fault ``diverged``.

An algorithm subclasses :class:`Learner` and provides ``train_step(train, reward)`` (one
step, returning its metrics) and ``evaluate(examples, reward, temperature)`` (the member's
fitness: larger is better, comparable across members whatever their hyperparameters). The
registry :data:`LEARNERS` maps ``algorithm.name`` to the class.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from pbt.algorithms.data.order import EpochOrder
from pbt.config import (
    MUTABLE_BY_ALGORITHM,
    MUTABLE_HYPERPARAMETERS,
    AlgorithmConfig,
    LoRAConfig,
    OptimConfig,
    RolloutConfig,
)
from pbt.config.errors import ConfigError, DivergedError
from pbt.config.sections.algorithm import INTEGER_HYPERPARAMETERS
from pbt.config.sections.fsdp import FSDPConfig
from pbt.distributed import all_reduce, world_info
from pbt.distributed.fsdp import average_gradients, is_sharded, set_gradient_sync
from pbt.distributed.state import (
    OptimizerOffload,
    gather_optimizer,
    load_optimizer,
    trainable_parameters,
)


class Learner:
    """The adapter's optimizer, schedule and hyperparameters, and the step that updates it.

    Args:
        model: a ``PeftModel`` (adapter trainable, base frozen) on its device.
        tokenizer: the matching tokenizer, with a chat template and a pad token.
        algorithm, optim, rollout: the component configs (copied; mutations change the copies).
        total_steps: training steps planned, for the learning-rate schedule.
        seed: seeds the learner's generator (mini-batch shuffles) and its data position (the
            order training rows are read in); the same on every rank, so all ranks draw the
            same global batch and take their own share.
        fsdp: the sharding options when ``model`` is sharded with FSDP2, else None.
        named_params: ``model``'s trainable parameters by name, in
            :func:`~pbt.distributed.state.trainable_parameters` order, when the caller listed
            them already (a host, once for all its members): listing walks every module of
            the model, milliseconds on a 0.5B model. None lists them here.
    """

    name: ClassVar[str] = ""
    fitness_name: ClassVar[str] = "fitness"
    """What :meth:`evaluate` measures, in words, for progress lines."""

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
        named_params: list[tuple[str, torch.nn.Parameter]] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.algorithm = AlgorithmConfig(**asdict(algorithm))
        self.optim_cfg = OptimConfig(**asdict(optim))
        self.rollout_cfg = copy.deepcopy(rollout)
        self.total_steps = total_steps
        self.step = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.data = EpochOrder(seed)
        """The data position: which training rows the next steps read (checkpointed)."""
        world = world_info()
        self.rank, self.world_size = world.rank, world.world_size
        self.device = next(model.parameters()).device
        self.defer_grad_sync = fsdp.defer_grad_sync if fsdp else False
        self._check_world()
        self.named_params = trainable_parameters(model) if named_params is None else named_params
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
        self.engine = None
        """The process's vLLM rollout engine with ``rollout.engine: vllm``; None samples through
        Hugging Face ``generate``."""
        self.adapter_name = "member"
        """This learner's adapter in the engine (its member's id in a shared-base population)."""
        self.adapter_stale = True
        """Whether the adapter changed since the engine last loaded it."""
        self.nonfinite_steps = 0
        """Optimizer steps skipped so far because their loss or gradient was NaN or inf."""
        self.nonfinite_in_a_row = 0
        """Of those, how many came in a row just now (reset by a finite step)."""
        self.zero_signal_in_a_row = 0
        """Training steps in a row just now whose every group had no signal (reset by a step
        with signal); member state, saved in checkpoints, so a clone or a resumed member keeps
        counting towards ``algorithm.collapse_patience``."""
        self._since_schedule = [0, 0]  # [updates, skipped] since the schedule last advanced

    @classmethod
    def prepare_model(cls, model, lora: LoRAConfig) -> None:
        """Add what this algorithm trains beside the policy adapter (PPO: a critic) to
        ``model``, in place, before it is sharded. Nothing for most algorithms."""

    # -- the global batch ------------------------------------------------------------------

    def global_batch_sizes(self) -> dict[str, int]:
        """The sizes that must split evenly over the ranks: ``{config key: value}``."""
        return self.algorithm.global_batch_sizes()

    def _check_world(self) -> None:
        problems = self.algorithm.world_problems(self.world_size)
        if problems:
            raise ConfigError(problems)

    def sample_prompts(self, train: Sequence) -> list:
        """This rank's share of the next ``prompts_per_step`` training examples.

        Rows are read epoch by epoch (every row once an epoch, see :class:`EpochOrder`). Every
        rank draws the same global list from the data position and keeps a contiguous slice,
        so the global batch does not depend on the world size.
        """
        count = min(self.algorithm.prompts_per_step, len(train))
        if hasattr(train, "stage_at"):  # a curriculum (task.stages): the step picks the stage
            order = self.data.take_staged(train, self.step, count)
        else:
            order = self.data.take(len(train), count)
        share = count // self.world_size
        return [train[i] for i in order[self.rank * share : (self.rank + 1) * share]]

    # -- learning rate and hyperparameters -------------------------------------------------

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

    @classmethod
    def mutable(cls) -> tuple[str, ...]:
        """The hyperparameters a mutation may change for this algorithm."""
        return MUTABLE_BY_ALGORITHM[cls.name]

    def _section(self, name: str) -> Any:
        """The config holding hyperparameter ``name``."""
        section = MUTABLE_HYPERPARAMETERS[name]
        return {"optim": self.optim_cfg, "algorithm": self.algorithm, "rollout": self.rollout_cfg}[
            section
        ]

    def hyperparameters(self) -> dict[str, float]:
        """Current values of this algorithm's mutable hyperparameters."""
        return {name: getattr(self._section(name), name) for name in self.mutable()}

    def apply_hyperparameters(self, values: dict[str, float]) -> None:
        """Set hyperparameters in place; a new lr lands in the optimizer and the schedule,
        keeping Adam's moments and the schedule's position. ``group_size`` and
        ``prompts_per_step`` are cast to int and take effect from the next step: every step
        reads its batch sizes and loss normalisation from the current values.

        Raises:
            ValueError: a name is not mutable for this algorithm.
            ConfigError: a new group size or prompts per step breaks a batch rule (the
                algorithm's, or the global batch splitting over this member's ranks); nothing
                is changed then.
        """
        unknown = set(values) - set(self.mutable())
        if unknown:
            raise ValueError(
                f"not mutable for {self.name}: {sorted(unknown)}; mutable: {list(self.mutable())}"
            )
        typed = {
            name: round(value) if name in INTEGER_HYPERPARAMETERS else float(value)
            for name, value in values.items()
        }
        self._check_batch({k: v for k, v in typed.items() if k in INTEGER_HYPERPARAMETERS})
        for name, value in typed.items():
            setattr(self._section(name), name, value)
        if "lr" in values:
            self.scheduler.base_lrs = [self.optim_cfg.lr for _ in self.optimizer.param_groups]
            factor = self._lr_factor(self.scheduler.last_epoch)
            for group in self.optimizer.param_groups:
                group["initial_lr"] = self.optim_cfg.lr
                group["lr"] = self.optim_cfg.lr * factor

    def _check_batch(self, sizes: dict[str, int]) -> None:
        """Raise :class:`ConfigError` when ``sizes`` (group size, prompts per step) would break
        a batch rule of this member."""
        if not sizes:
            return
        changed = AlgorithmConfig(**(asdict(self.algorithm) | sizes))
        problems = changed.batch_problems(self.world_size)
        if problems:
            raise ConfigError(problems)

    # -- the optimizer step ----------------------------------------------------------------

    def _optimizer_step(self, loss: float = 0.0) -> float | None:
        """Average gradients over ranks (data parallel), clip, step; returns the grad norm.

        Args:
            loss: this rank's loss of the step (any scale), checked for NaN and inf.

        Returns:
            The gradient norm before clipping, or None when the step was skipped because the
            loss on some rank or the gradient is not finite (see :meth:`_skip_nonfinite`).

        Raises:
            DivergedError: ``algorithm.max_nonfinite_steps`` steps in a row were skipped.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if not is_sharded(self.model):
            average_gradients(params)
        max_norm = self.optim_cfg.max_grad_norm if self.optim_cfg.max_grad_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norm = float(norm)
        if self._skip_nonfinite(loss, norm):
            return None
        self._state_to_device()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._state_to_host()
        self.adapter_stale = True
        self._since_schedule[0] += 1
        return norm

    def _skip_nonfinite(self, loss: float, norm: float) -> bool:
        """Whether to skip this step: True on every rank when any rank's loss, or the gradient
        norm, is NaN or inf. A skipped step's gradients are zeroed and it is counted; the
        ``max_nonfinite_steps``-th in a row raises :class:`DivergedError` (on every rank)."""
        bad = 0.0 if math.isfinite(loss) and math.isfinite(norm) else 1.0
        if all_reduce([bad], "max")[0] == 0.0:
            self.nonfinite_in_a_row = 0
            return False
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        self._since_schedule[1] += 1
        limit = self.algorithm.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise DivergedError(self.nonfinite_in_a_row, limit, self.step)
        return True

    def _count_signal(self, zero_signal: bool) -> None:
        """Count a zero-signal training step in a row, or reset the count on a step with signal."""
        self.zero_signal_in_a_row = self.zero_signal_in_a_row + 1 if zero_signal else 0

    @property
    def collapsed(self) -> bool:
        """Whether ``algorithm.collapse_patience`` steps in a row had no signal just now."""
        patience = self.algorithm.collapse_patience
        return patience is not None and self.zero_signal_in_a_row >= patience

    def _advance_schedule(self) -> None:
        """Advance the learning-rate schedule by one training step, unless the step made
        optimizer steps and every one was skipped as non-finite (a step that made none, such
        as a zero-signal one, still advances it)."""
        updates, skipped = self._since_schedule
        self._since_schedule = [0, 0]
        if skipped and not updates:
            return
        # torch warns when a scheduler steps without an optimizer step (a zero-signal step),
        # which here is intended: the schedule follows training steps.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def _update_in_mini_batches(
        self,
        rows: int,
        weight: Callable[[Tensor], float],
        loss: Callable[[Tensor], tuple[Tensor, dict[str, float]]],
    ) -> tuple[dict[str, float], float, int]:
        """``update_epochs`` passes over this rank's ``rows`` in mini-batches, one optimizer step
        each, micro-batches accumulating gradients.

        ``loss(idx)`` returns the summed loss of rows ``idx`` (with grad) and statistics to
        sum; ``weight(idx)`` what a mini-batch's loss is divided by (its tokens or its
        examples), summed over ranks, so the step is the same at any world size and
        micro-batch size. Every rank has the same ``rows`` and makes the same number of forward
        passes and optimizer steps.

        Returns:
            ``(summed statistics, mean gradient norm, optimizer steps)``: statistics, norm and
            steps of the steps taken; ``totals["nonfinite_steps"]`` counts those skipped as
            non-finite, whose statistics are left out.
        """
        algo = self.algorithm
        mini = (algo.mini_batch_size or algo.batch_completions) // self.world_size
        micro = min(algo.micro_batch_size or mini, mini)
        totals: dict[str, float] = {"nonfinite_steps": 0.0}
        norms, steps = 0.0, 0
        for _ in range(algo.update_epochs):
            order = torch.randperm(rows, generator=self.generator)
            for start in range(0, rows, mini):
                batch = order[start : start + mini]
                denominator = max(all_reduce([weight(batch)])[0], 1e-9)
                chunks = [batch[s : s + micro] for s in range(0, len(batch), micro)]
                step_totals: dict[str, float] = {}
                step_loss = 0.0
                for i, idx in enumerate(chunks):
                    set_gradient_sync(self.model, not self.defer_grad_sync or i == len(chunks) - 1)
                    value, stats = loss(idx)
                    # gradients are averaged across ranks: scale by the world size to sum them
                    scaled = value / denominator * self.world_size
                    scaled.backward()
                    step_loss += float(scaled.detach())
                    for key, item in stats.items():
                        step_totals[key] = step_totals.get(key, 0.0) + item
                norm = self._optimizer_step(step_loss)
                taken = norm is not None
                totals["nonfinite_steps"] += 0.0 if taken else 1.0
                for key, item in step_totals.items():
                    totals[key] = totals.get(key, 0.0) + (item if taken else 0.0)
                if not taken:
                    continue
                norms += norm
                steps += 1
        return totals, norms / max(steps, 1), steps

    def memory_metrics(self) -> dict[str, float]:
        """Peak GPU memory so far (on CUDA), for the step's metrics."""
        if self.device.type != "cuda":
            return {}
        return {"gpu_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}

    def _state_to_device(self) -> None:
        if self.offload is not None:
            self.offload.to_device()

    def _state_to_host(self) -> None:
        if self.offload is not None:
            self.offload.to_host()

    # -- what an algorithm provides --------------------------------------------------------

    def train_step(self, train: list, reward=None) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, examples: list, reward=None, temperature: float = 0.0) -> float:
        raise NotImplementedError

    def plain_step(self, reward=None) -> bool:
        """Whether a population batch may run this learner's training step together with
        other members' (:mod:`pbt.algorithms.runtime.population_train`); see GRPO's."""
        return False

    def describe(self, metrics: dict[str, float]) -> str:
        """A short progress line for one step's metrics."""
        return f"loss {metrics.get('loss', float('nan')):+.4f}"

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (gathered, by parameter name), scheduler, step, generator and data position.

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
            "data": self.data.state_dict(),
            "zero_signal_in_a_row": self.zero_signal_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, on any world size."""
        load_optimizer(self.named_params, self.optimizer, state["optimizer"])
        self._state_to_host()
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
        if "data" in state:  # checkpoints older than the data position start a fresh epoch
            self.data.load_state_dict(state["data"])
        # absent from checkpoints written before collapse was counted: no steps in a row then
        self.zero_signal_in_a_row = int(state.get("zero_signal_in_a_row", 0))
        self.adapter_stale = True


def learner_class(name: str) -> type[Learner]:
    """The learner of algorithm ``name`` (imported on first use)."""
    import importlib

    module, attribute = LEARNERS[name]
    return getattr(importlib.import_module(module), attribute)


LEARNERS: dict[str, tuple[str, str]] = {
    "GRPO": ("pbt.algorithms.grpo", "GRPO"),
    "REINFORCE": ("pbt.algorithms.grpo", "REINFORCE"),
    "PPO": ("pbt.algorithms.ppo", "PPO"),
    "SFT": ("pbt.algorithms.sft", "SFT"),
    "DPO": ("pbt.algorithms.dpo", "DPO"),
}
"""``algorithm.name`` -> (module, class)."""
