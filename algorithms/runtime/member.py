"""A member: one model with its adapter, task and learner, and its checkpoint.

This is what a torchrun group trains. Saving gathers everything a member is into one
checkpoint (see :mod:`pbt.algorithms.runtime.checkpoint`); loading a checkpoint and training on gives
exactly what training straight through would have given. :meth:`Member.train` is the one step
loop: the task worker, standalone ``pbt train`` and library mode all train through it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pbt.algorithms.data.tasks import Task, load_task
from pbt.algorithms.learner import Learner, learner_class
from pbt.algorithms.rollout.dedicated import dedicated_rollouts
from pbt.algorithms.runtime.activations import checkpoint_blocks, offload_activations
from pbt.algorithms.runtime.checkpoint import (
    adapter_config,
    load_checkpoint,
    peft_key,
    save_checkpoint,
)
from pbt.algorithms.runtime.models import (
    adapter_dir_base,
    add_lora,
    compile_decoder,
    load_base_model,
    load_tokenizer,
    quiet_transformers,
    resolve_model_path,
    set_mixed_precision,
)
from pbt.config import RL_ALGORITHMS, Manifest
from pbt.config.errors import CheckpointError
from pbt.config.sections.fsdp import FSDPConfig
from pbt.distributed import all_gather_objects, barrier, init_process_group
from pbt.distributed.fsdp import shard_model
from pbt.distributed.state import (
    HostCopies,
    copies_in_background,
    fresh_device_copies,
    gather_parameters,
    load_parameters,
    trainable_parameters,
)
from pbt.protocol.collapse import collapse_detail, diagnosis, is_zero_signal

StepCallback = Callable[[int, dict[str, float]], None]
"""Called after each training step with the lineage's step count and the step's metrics."""


class Host:
    """One frozen base model with its adapter slot, the tokenizer and the task, in this process.

    Every member hosted in the process trains through this one model: a campaign worker holds
    one member, a library-mode population many (see :mod:`pbt.algorithms.runtime.shared_base`).

    Args:
        manifest: the validated run configuration.
        device: where the model lives.
    """

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.manifest = manifest
        self.device = device
        self._config: dict[str, Any] | None = None  # asdict(manifest), once asked for
        quiet_transformers()
        self.world = init_process_group(device, manifest.distributed.timeout_s)
        # The same seed on every rank while the adapter is initialised (data-parallel replicas
        # and FSDP shards must start from one set of weights), then one stream per rank for
        # sampling.
        seed_everything(manifest.training.seed)
        self.tokenizer = load_tokenizer(manifest.model, manifest.base_dir)
        base = load_base_model(manifest.model, device, manifest.base_dir)
        self.model = add_lora(base, manifest.lora)
        learner_class(manifest.algorithm.name).prepare_model(self.model, manifest.lora)
        if manifest.training.activation_checkpointing:
            checkpoint_blocks(base)  # before sharding: FSDP's hooks stay outside the recompute
        self.fsdp = FSDPConfig.from_value(manifest.distributed.fsdp)
        if self.fsdp is not None:
            shard_model(self.model, base, self.fsdp, device)
        if manifest.training.activation_offloading:
            offload_activations(self.model, device)
        set_mixed_precision(self.model, manifest.training.mixed_precision and self.fsdp is None)
        if manifest.training.compile:
            compile_decoder(self.model)
        self.named_trainable = trainable_parameters(self.model)
        """``(name, parameter)`` of the adapter slot, listed once: listing walks every module
        of the model (milliseconds on a 0.5B model), and each new member's learner needs it."""
        self.trainable = [p for _, p in self.named_trainable]
        self.initial_adapter = [local_shard(p).detach().clone() for p in self.trainable]
        """The adapter (and any other trained module) as initialised: what a new member starts
        from (this rank's shards under FSDP2)."""
        seed_everything(manifest.training.seed + self.world.rank)
        self.task: Task = load_data(manifest)
        self.row_adapters = None
        """Every member's adapter stacked for batches of several members
        (:class:`~pbt.algorithms.runtime.lora_batch.RowAdapters`), made on the first batch and
        kept with the model: the batched decoder's captured graphs read these tensors, so
        every batch this host runs loads its members into the same ones."""
        self.rollout_engine = None
        """This rank's dedicated rollout engine process (``launch.rollout_gpus_per_member``),
        started by the first member that trains here (:mod:`pbt.algorithms.rollout.dedicated`)."""
        self.engine = None
        if manifest.rollout.engine == "vllm":
            from pbt.algorithms.rollout.vllm import VLLMRollout

            self.engine = VLLMRollout(
                manifest,
                resolve_model_path(manifest.model.name, manifest.base_dir),
                self.tokenizer,
                device,
            )

    def serves(self, manifest: Manifest) -> bool:
        """Whether a member of ``manifest`` can train on this host (the same configuration:
        a campaign's members differ only in hyperparameters, applied to their learners).

        A long-lived worker asks before every task, usually with the very manifest object the
        host was built from (it parses each distinct manifest once); the host's own
        ``asdict`` is computed once, not per task."""
        if manifest is self.manifest:
            return True
        if self._config is None:
            self._config = asdict(self.manifest)
        return asdict(manifest) == self._config

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """Put the adapter slot back to its initial values, for a member starting afresh.

        One batched copy: a copy per tensor costs a kernel launch each on a GPU, and an
        adapter is hundreds of tensors."""
        torch._foreach_copy_([local_shard(p) for p in self.trainable], self.initial_adapter)

    def new_learner(self) -> Learner:
        """The algorithm's learner, with its own optimizer, schedule and generator over the
        adapter slot."""
        m = self.manifest
        learner = learner_class(m.algorithm.name)(
            self.model,
            self.tokenizer,
            m.algorithm,
            m.optim,
            m.rollout,
            total_steps=m.training.steps,
            seed=m.training.seed,
            fsdp=self.fsdp,
            named_params=list(self.named_trainable),
        )
        learner.engine = self.engine
        return learner


class Member:
    """A learner over a host's model, with the member's fitness and lineage.

    Args:
        manifest: the validated run configuration.
        device: where the model lives.
        member_id: this member's name in lineage records.
        host: the model to train through; built from ``manifest`` when omitted.
        engine_status_dir: the folder where this member's dedicated rollout engines report
            (a campaign task's folder, read by ``pbt status``); None: they do not.
    """

    def __init__(
        self,
        manifest: Manifest,
        device: torch.device,
        member_id: str = "member-0",
        host: Host | None = None,
        engine_status_dir: Path | None = None,
    ) -> None:
        self.host = host or Host(manifest, device)
        self.engine_status_dir = engine_status_dir
        self.manifest = manifest
        self.device = device
        self.member_id = member_id
        self.world = self.host.world
        self.tokenizer = self.host.tokenizer
        self.model = self.host.model
        self.fsdp = self.host.fsdp
        self.task = self.host.task
        self.learner = self.host.new_learner()
        self.learner.adapter_name = member_id
        self.fitness: list[float] = []
        self.mutation_ranges: dict[str, dict[str, Any]] = {
            name: dict(spec) for name, spec in manifest.mutation.ranges.items()
        }
        self.lineage: dict[str, Any] = {
            "member": member_id,
            "parent": None,
            "generation": 0,
            "mutation": None,
        }
        self.diagnosed = False
        """Whether this member's lack of signal was explained already (it is, once)."""
        self.stopped = False
        """Whether :meth:`train` ended early because the member collapsed."""

    @property
    def collapsed(self) -> bool:
        """Whether the member's last ``algorithm.collapse_patience`` steps all had no signal."""
        return self.learner.collapsed

    def collapse_detail(self) -> str:
        """Why the member counts as collapsed, in words."""
        learner = self.learner
        patience = self.manifest.algorithm.collapse_patience or 0
        return collapse_detail(learner.zero_signal_in_a_row, patience, learner.step)

    def train_step(self) -> dict[str, float]:
        """One training step on the task's training split; returns its metrics."""
        return self.learner.train_step(self.task.train, self.task.reward)

    def train(
        self,
        steps: int,
        on_step: StepCallback | None = None,
        say: Callable[[str], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train ``steps`` steps, or fewer when the member collapses; returns every step's
        metrics, each with its ``"step"``.

        The member collapses when ``algorithm.collapse_patience`` steps in a row had no signal
        (:attr:`collapsed`); training stops there, so the caller can evaluate and save it and
        selection replace it (:attr:`stopped`). A member that starts collapsed (a clone of
        one) trains one step before it is judged again.

        Args:
            steps: how many steps to take at most.
            on_step: called after each step with the lineage's step count (parents' steps
                included) and the step's metrics: where the caller prints, records or logs.
            say: where the member's first step that learned nothing (every group's rewards
                identical, so the update was skipped) is explained, once, as ``step N: <why,
                and what to change>``, and where a collapse is announced; None says nothing.
        """
        with dedicated_rollouts(self.host, self.learner, self.member_id, self.engine_status_dir):
            return self._train(steps, on_step, say)

    def _train(
        self, steps: int, on_step: StepCallback | None, say: Callable[[str], None] | None
    ) -> list[dict[str, float]]:
        history: list[dict[str, float]] = []
        for _ in range(steps):
            if self.record_step(self.train_step(), history, on_step, say):
                break
        return history

    def record_step(
        self,
        metrics: dict[str, float],
        history: list[dict[str, float]],
        on_step: StepCallback | None,
        say: Callable[[str], None] | None,
    ) -> bool:
        """Account for a training step that gave ``metrics`` (:meth:`train`'s explanations and
        callback; the metrics appended to ``history``); whether the member stops there,
        collapsed."""
        step = self.learner.step
        if say is not None and is_zero_signal(metrics) and not self.diagnosed:
            self.diagnosed = True
            say(f"step {step}: {diagnosis(metrics)}")
        if on_step is not None:
            on_step(step, metrics)
        history.append({"step": step, **metrics})
        if not self.collapsed:
            return False
        self.stopped = True
        if say is not None:
            say(f"step {step}: collapsed: {self.collapse_detail()}")
        return True

    def attributes(self) -> dict[str, Any]:
        """Everything the member is, as plain data for ``attributes.pt``: every tensor a fresh
        copy on the CPU, so later training does not reach it.

        A collective: every rank calls it; sharded state is gathered into full tensors.
        """
        named = self.learner.named_params
        return {
            "algorithm": self.manifest.algorithm.name,
            "base_model": self.manifest.model.name,
            "quantization": quantization_record(self.manifest),
            "lora_config": asdict(self.manifest.lora),
            "hyperparameters": self.learner.hyperparameters(),
            "mutation_ranges": {k: dict(v) for k, v in self.mutation_ranges.items()},
            "trainable": {peft_key(n): t for n, t in gather_parameters(named).items()},
            "learner": self.learner.state_dict(),
            "rng": all_gather_objects(capture_rng()),
            "world_size": self.world.world_size,
            "step": self.learner.step,
            "fitness": list(self.fitness),
            "lineage": dict(self.lineage),
        }

    def save(self, path: str | Path) -> str | None:
        """Write the checkpoint (rank 0) and return its digest; other ranks return None.

        A collective: every rank calls it.
        """
        write = self.snapshot(path)
        digest = write() if write is not None else None
        barrier()
        return digest

    def snapshot(self, path: str | Path) -> Snapshot | None:
        """Copy the member's state to host memory now; return, on rank 0, the
        :class:`Snapshot` whose call writes it to ``path`` as a checkpoint and returns its
        digest (None on other ranks).

        The write needs neither the device nor the other ranks, so it may run while the model
        trains the next member. On one GPU the copy itself is still travelling when this
        returns: packed on the device, it reaches pinned host memory on a side stream while
        the next member starts, and the write waits for it. A collective: every rank calls it.
        """
        if self.world.world_size > 1 or torch.device(self.device).type != "cuda":
            attributes, copies = self.attributes(), None
        else:
            with copies_in_background() as copies:
                attributes = self.attributes()
        if self.world.rank != 0:
            return None
        return Snapshot(Path(path), attributes, self._adapter_config(), copies)

    def _adapter_config(self) -> dict[str, Any]:
        return adapter_config(
            self.model, adapter_dir_base(self.manifest.model.name, self.manifest.base_dir)
        )

    def load(
        self, path: str | Path, held: dict[str, Any] | None = None, owned: bool = False
    ) -> dict[str, Any]:
        """Restore adapter, optimizer, scheduler, RNG, step, fitness and lineage from ``path``,
        or from ``held``: the same checkpoint's attributes already in memory (a
        :class:`Snapshot`'s, once written, whose digest the caller has matched), which are not
        changed: the tensors the optimizer would take over (on the CPU, or held on the device)
        are copied first, unless ``owned``: a copy made for this load alone, such as a
        prefetch's.

        Raises:
            CheckpointError: the checkpoint is invalid or belongs to another model or algorithm.
        """
        if held is None:
            attrs = load_checkpoint(path)
        elif owned:
            attrs = held
        elif torch.device(self.device).type == "cpu":
            attrs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, held)
        else:  # a state held on the device: a copy a packed buffer (host tensors travel below)
            attrs = fresh_device_copies(held)
        self._check_compatible(attrs, path)
        named = self.learner.named_params
        saved = attrs["trainable"]
        if set(saved) != {peft_key(n) for n, _ in named}:
            raise CheckpointError(
                f"checkpoint {path}: its adapter tensors do not fit this model's adapter"
            )
        try:
            load_parameters(named, {n: saved[peft_key(n)] for n, _ in named})
        except KeyError as err:
            raise CheckpointError(f"checkpoint {path}: {err.args[0]}") from None
        self.learner.load_state_dict(attrs["learner"])
        self.learner.apply_hyperparameters(attrs["hyperparameters"])
        self._restore_rng(attrs["rng"])
        self.fitness = [float(f) for f in attrs["fitness"]]
        self.mutation_ranges = {k: dict(v) for k, v in attrs.get("mutation_ranges", {}).items()}
        self.lineage = dict(attrs["lineage"])
        return attrs

    def _restore_rng(self, states: list[dict[str, Any]]) -> None:
        """Each rank takes its own saved stream; on another world size, a stream derived from
        rank 0's (a resume on a new world size cannot replay the old sampling anyway)."""
        if len(states) == self.world.world_size:
            restore_rng(states[self.world.rank])
            return
        restore_rng(states[0])
        if self.world.rank:
            seed_everything(int(torch.randint(0, 2**31 - 1, (1,))) + self.world.rank)

    def _check_compatible(self, attrs: dict[str, Any], path: str | Path) -> None:
        check_quantization(attrs, self.manifest, path)
        expected = {
            "algorithm": self.manifest.algorithm.name,
            "base_model": self.manifest.model.name,
            "lora_config": asdict(self.manifest.lora),
        }
        for key, value in expected.items():
            if attrs.get(key) != value:
                raise CheckpointError(
                    f"checkpoint {path} has {key} {attrs.get(key)!r} but this run uses {value!r}; "
                    "load it with the manifest it was trained with"
                )


def quantization_record(manifest: Manifest) -> dict[str, Any] | None:
    """``model.quantization`` as ``attributes.pt`` records it (None: an unquantized base)."""
    quant = manifest.model.quantization
    return None if quant is None else asdict(quant)


def describe_quantization(record: dict[str, Any] | None) -> str:
    """A quantization record in words."""
    if record is None:
        return "an unquantized base"
    double = ", double quantization" if record.get("double_quant") else ""
    return (
        f"a 4-bit {record.get('quant_type')} base (compute {record.get('compute_dtype')}, storage "
        f"{record.get('storage_dtype')}{double})"
    )


def check_quantization(attrs: dict[str, Any], manifest: Manifest, path: str | Path) -> None:
    """A checkpoint's adapter fits the base it was trained on: the same quantization (or none).

    Raises:
        CheckpointError: the checkpoint was trained on another quantization of the base.
    """
    saved, now = attrs.get("quantization"), quantization_record(manifest)
    if saved == now:
        return
    if saved is None:
        fix = "remove model.quantization to resume it"
    else:
        fields = ", ".join(
            f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in saved.items()
        )
        fix = f"set model.quantization to {{{fields}}} to resume it"
    raise CheckpointError(
        f"checkpoint {path} was trained on {describe_quantization(saved)}, but this run loads "
        f"{describe_quantization(now)}: the adapter learned to correct the weights it saw, so it "
        f"would drift on others; {fix} (pbt export --merge turns it into a full model)"
    )


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter; the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


class Snapshot:
    """A member's state in host memory; calling it writes the checkpoint and returns its
    digest (kept as ``digest``)."""

    def __init__(
        self,
        path: Path,
        attributes: dict[str, Any],
        config: dict[str, Any],
        copies: HostCopies | None = None,
    ) -> None:
        self.path, self.attributes, self.config = path, attributes, config
        self.digest: str | None = None
        self.cache_as: str | None = None
        """The checkpoint path (relative to the campaign) a worker's state cache keeps this
        state under once written; None: not kept."""
        self.keep_on_device = False
        """Whether to keep :attr:`on_device` (the caller holds states on the device)."""
        self.on_device: dict[str, Any] | None = None
        """Once written, on a GPU, when asked for: the state again as views of the packed
        device buffers its host copy came from (for a child in this worker)."""
        self._copies = copies

    def __call__(self) -> str:
        if self._copies is not None:  # the bytes from the device, before anything reads them
            if self.keep_on_device:
                self.on_device = self._copies.device_views(self.attributes)
            self.attributes = self._copies.settle(self.attributes)
            self._copies = None
        self.digest = save_checkpoint(self.path, self.attributes, self.config)
        return self.digest

    def state(self) -> dict[str, Any]:
        """The state as it is held now, its bytes arrived from the device, whether or not it
        has been written yet: for a child loaded in this process without waiting for the
        file. To be read only (the write may be reading it meanwhile)."""
        copies = self._copies
        if copies is not None:
            copies.wait()
        return self.attributes

    def nbytes(self) -> int:
        """Bytes of tensor data held."""
        leaves = torch.utils._pytree.tree_leaves(self.attributes)
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def load_data(manifest: Manifest) -> Task:
    """What the algorithm learns from: prompts with a reward (GRPO, REINFORCE), prompt/response
    pairs (SFT) or preference pairs (DPO), split into train and held-out eval by the campaign's
    ``training.seed`` (the same split for every member)."""
    cfg, seed = manifest.task, manifest.training.seed
    if manifest.algorithm.name in RL_ALGORITHMS:
        return load_task(cfg, manifest.base_dir, seed)
    from pbt.algorithms.data.supervised import load_preferences, load_sft

    load = load_sft if manifest.algorithm.name == "SFT" else load_preferences
    data = load(cfg, manifest.base_dir, seed)
    return Task(data.name, data.train, data.eval, reward=None)


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """The global RNG states as plain data (tensors and lists)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
