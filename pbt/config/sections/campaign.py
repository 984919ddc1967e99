"""The campaign sections: population, mutation, search, budget, launch and tracking."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pbt.config.rules import (
    Bound,
    Count,
    PositiveFloat,
    PositiveInt,
    Seconds,
    bound_problems,
)


@dataclass(kw_only=True, slots=True)
class PopulationConfig:
    """The population of a campaign and how it is selected."""

    size: PositiveInt = 4
    selection: Literal["tournament", "truncation", "multi_frequency"] = "tournament"
    """``tournament``: every slot but the elite's is the winner of a tournament (AgileRL's).
    ``truncation``: the bottom ``truncation_fraction`` copy members of the top one and mutate;
    the rest continue unchanged (the original PBT's exploit). ``multi_frequency``: groups of
    slots evolve at different frequencies and migrate into each other (multiple-frequencies
    PBT, as AgileRL ships it)."""
    truncation_fraction: float = 0.25
    exploit_gap: float = 0.0
    """Truncation: a bottom member is replaced only when its new parent's fitness is more than
    this above its own (set it near the evaluation's noise to exploit only real differences)."""
    ready_generations: Count = 0
    """Truncation: nobody is replaced before the population has trained this many generations
    (a burn-in: slow starters are not cut early); a collapsed or unevaluated member still is."""
    subpopulations: int = 2
    """Multi-frequency: the number of groups, of ``size / subpopulations`` slots each."""
    frequencies: list[int] | None = None
    """Multi-frequency: generations between two evolutions of each group, strictly increasing
    (default ``1, 5, 10, ...``)."""
    brackets: list[int] | None = None
    """Multi-frequency: ``[winners, survivors, open, losers]`` of a group, summing to its size
    (default a quarter winners, no survivors, a quarter open to migrants, the rest losers)."""
    tournament_size: int = 2
    elitism: bool = True
    """Keep the best member unchanged into the next generation (tournament)."""
    fitness_window: PositiveInt = 1
    """Fitness is the mean of this many latest evaluations."""
    evo_steps: PositiveInt = 10
    """Training steps of each member between two selections."""
    init_sampler: Literal["none", "random", "qmc", "tpe"] = "none"
    """How generation 0's hyperparameters are drawn from the mutation ranges (log-uniform where
    a range says ``log``): ``none`` keeps the manifest's values for every member, ``random``
    samples independently, ``qmc`` spreads the population evenly (scrambled Sobol), ``tpe``
    learns from ``warm_start``'s trials."""
    warm_start: str | None = None
    """An earlier campaign's directory whose Optuna study seeds ``tpe`` (relative to the
    manifest's folder)."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.warm_start is not None and self.init_sampler != "tpe":
            problems.append(
                f"{prefix}.warm_start ({self.warm_start!r}) only informs init_sampler: tpe, "
                f"but init_sampler is {self.init_sampler!r}; set init_sampler: tpe or drop "
                "warm_start"
            )
        if self.selection == "truncation":
            problems += truncation_problems(
                self.truncation_fraction, self.exploit_gap, self.ready_generations
            )
        if self.selection == "multi_frequency":
            problems += multi_frequency_problems(
                self.size, self.subpopulations, self.frequencies, self.brackets
            )
        return problems


@dataclass(kw_only=True, slots=True)
class MutationConfig:
    """How a selected parent's hyperparameters change in its child."""

    no_mutation: float = 0.4
    """Relative probability of leaving the child's hyperparameters as the parent's."""
    rl_hp: float = 0.6
    """Relative probability of changing one hyperparameter."""
    mutate_elite: bool = False
    resample_probability: float = 0.0
    """Chance that a changed hyperparameter is drawn afresh from its range instead of scaled."""
    perturb: Literal["one", "all"] = "one"
    """``one``: a mutated child changes one hyperparameter, drawn uniformly (AgileRL's).
    ``all``: every searched hyperparameter changes at once (the original PBT's explore; with
    ``no_mutation: 0`` every copy is explored)."""
    perturb_survivors: bool = False
    """Truncation selection: also mutate the members that continue their own lineage."""
    ranges: dict[str, dict[str, object]] = field(
        default_factory=lambda: {"lr": {"min": 1e-6, "max": 1e-2, "log": True}}
    )
    """Per hyperparameter: ``{min, max, grow_factor: 1.2, shrink_factor: 0.8, log, dtype}``;
    by default only the learning rate mutates."""

    def check(self, prefix: str) -> list[str]:
        return []  # with the ranges: pbt.config.ranges.campaign_problems


@dataclass(kw_only=True, slots=True)
class SearchConfig:
    """The search strategy: population-based training, or Optuna trials from scratch."""

    strategy: Literal["pbt", "pb2", "optuna"] = "pbt"
    """``pbt``: selection and mutation every generation. ``pb2``: truncation selection, and each
    copy's hyperparameters chosen by a GP bandit over what every member's did (PB2's explore;
    needs ``population.selection: truncation``). ``optuna``: every member is an Optuna trial
    trained from scratch for ``trial_generations`` generations, its fitness reported after
    each; pruned and finished trials make way for new ones."""
    sampler: Literal["tpe", "gp", "random", "qmc"] = "tpe"
    """How the ``optuna`` strategy picks each new trial's hyperparameters."""
    pruner: Literal["median", "hyperband", "successive_halving", "none"] = "median"
    """``median`` prunes against complete trials only, so with every slot's trial as long as the
    campaign it never prunes; ``successive_halving`` and ``hyperband`` compare trials at the
    same generation and free slots early."""
    trial_generations: PositiveInt = 4
    """Generations one trial trains at most (the pruner's full budget)."""
    startup_trials: Count = 4
    """Trials completed before the pruner and the sampler start deciding."""

    def check(self, prefix: str) -> list[str]:
        return bound_problems(self, prefix)


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    """How a campaign is watched: where its runs, metrics and artifacts are logged (MLflow),
    and how often the controller prints its progress lines."""

    enabled: bool = True
    uri: str | None = None
    """A tracking server (``http://host:5000``) or store URI; default an embedded SQLite store,
    ``<campaign>/mlflow.db``."""
    experiment: str | None = None
    """Default: ``campaign <campaign directory>``."""
    progress_every_s: ProgressSeconds = 10.0
    """Seconds between the controller's plain progress lines (each running member's step,
    reward and ETA) when its output is not a terminal (a pipe, a file, a batch job's log); 0
    prints none. On a terminal, bars are redrawn instead. The environment variable
    ``PBT_PROGRESS_EVERY`` overrides it."""

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.uri is not None and "://" not in self.uri:
            problems.append(
                f"{prefix}.uri ({self.uri!r}) must be a URI such as http://127.0.0.1:5000 or "
                "sqlite:///path/mlflow.db; leave it unset for the campaign's own store"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class BudgetConfig:
    """When a campaign stops: the first limit reached."""

    generations: PositiveInt = 3
    total_steps: PositiveInt | None = None
    """Training steps summed over all members."""
    wall_time_s: Seconds | None = None
    gpu_hours: PositiveFloat | None = None
    target_fitness: float | None = None
    """Stop as soon as the best member reaches this fitness."""

    def check(self, prefix: str) -> list[str]:
        return bound_problems(self, prefix)


MIN_MEMORY_LIMIT_GIB = 0.25
"""The lowest ``launch.memory_limit_gib``: below it not even a small member program starts."""
MemoryGiB = Annotated[
    float,
    Bound(
        MIN_MEMORY_LIMIT_GIB,
        strict=False,
        fix="a member process imports torch in about half a GiB; raise it, or leave it unset "
        "for no limit",
    ),
]


CacheGiB = Annotated[float, Bound(0, strict=False, fix="0 keeps none")]
ProgressSeconds = Annotated[float, Bound(0, strict=False, fix="0 prints none")]


_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$|^(UNLIMITED|INFINITE)$")
"""Slurm's ``--time`` forms: minutes, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``."""


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    """Where and how member jobs are submitted when ``launch.backend`` is ``slurm``."""

    partition: str | None = None
    """``--partition``; None: the cluster's default partition."""
    account: str | None = None
    qos: str | None = None
    time: str | None = "04:00:00"
    """``--time`` of each member job (a long-lived worker job: of the worker). Past it Slurm
    ends the job and the attempt is recorded as ``timeout``."""
    nodes_per_member: PositiveInt = 1
    """Nodes of each member job: ``srun`` starts one torchrun agent per node, which meet over
    c10d with the first node of the allocation as the endpoint and the job id as the
    rendezvous id."""
    gpus_per_node: PositiveInt | None = None
    """GPUs each node gives a member (``--gpus-per-node``); default ``gpus_per_member /
    nodes_per_member``."""
    tasks_per_node: PositiveInt = 1
    """torchrun agents per node. 1 on a real cluster; 2 lets one host stand in for two nodes
    (each agent then runs half the node's ranks), which is how the tests check multi-node
    members on a single machine."""
    cpus_per_task: PositiveInt | None = None
    mem: str | None = None
    """``--mem`` per node, e.g. ``"64G"``; past it Slurm ends the job (``out_of_memory``)."""
    constraint: str | None = None
    extra_sbatch: list[str] = field(default_factory=list)
    """More ``#SBATCH`` options, each as written after it, e.g. ``["--exclusive"]``."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run first in every job, e.g. ``module load cuda`` or ``source venv/bin/activate``."""
    poll_s: Seconds = 2.0
    """Seconds between two looks at the queue (one ``squeue`` for all the campaign's jobs)."""

    def check(self, prefix: str, launch: LaunchConfig) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.time is not None and not _SLURM_TIME.match(self.time):
            problems.append(
                f'{prefix}.time ({self.time!r}) is not a Slurm time; write minutes, "MM:SS", '
                '"HH:MM:SS" or "D-HH:MM:SS", e.g. time: "04:00:00"'
            )
        for i, line in enumerate(self.extra_sbatch):
            if not line.startswith("-"):
                problems.append(
                    f"{prefix}.extra_sbatch[{i}] ({line!r}) must be an sbatch option as written "
                    'after #SBATCH, starting with "-", e.g. "--exclusive"'
                )
        agents = self.nodes_per_member * self.tasks_per_node
        if launch.gpus_per_member:
            per_node = self.gpus_per_node or launch.gpus_per_member // max(1, self.nodes_per_member)
            if per_node * self.nodes_per_member != launch.gpus_per_member:
                problems.append(
                    f"launch.gpus_per_member ({launch.gpus_per_member}) must be "
                    f"{prefix}.nodes_per_member ({self.nodes_per_member}) x gpus_per_node "
                    f"({per_node}); change one of them"
                )
            elif per_node % self.tasks_per_node:
                problems.append(
                    f"{prefix}.tasks_per_node ({self.tasks_per_node}) must divide the GPUs of a "
                    f"node ({per_node})"
                )
        elif agents > 0 and launch.nproc_per_member % agents:
            problems.append(
                f"launch.nproc_per_member ({launch.nproc_per_member}) must be a multiple of the "
                f"member's torchrun agents ({prefix}.nodes_per_member x tasks_per_node = "
                f"{agents}); each agent runs the same number of ranks"
            )
        return problems


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """How member tasks are run."""

    backend: Literal["local", "slurm"] = "local"
    """``local``: each member a process group on this machine; ``slurm``: each member task a
    Slurm job (see ``launch.slurm``), the controller anywhere that can run ``sbatch``."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    gpus_per_member: Count = 0
    """GPUs (and torchrun ranks) per member; 0 runs each member on the CPU."""
    nproc_per_member: PositiveInt = 1
    """Ranks per member when ``gpus_per_member`` is 0 (CPU processes)."""
    rollout_gpus_per_member: Count | Literal["auto"] = 0
    """Dedicated rollout engines of a member (AgileRL Arena's ``rollout_engines_per_agent``),
    one per trainer rank: processes that sample with the member's latest adapter while it
    trains (``rollout.mode``). 0: the trainer samples itself (colocated). Each engine gets a
    GPU of its own when enough are visible beyond the trainers'; else (one GPU, or MPS on) it
    shares its trainer's GPU as its own process. ``auto``: engines on GPUs of their own if the
    spare GPUs hold one per trainer rank for every slot, else shared GPUs for ``rollout.mode:
    async`` and none (colocated) for ``sync``; ``pbt check`` says which. See docs/rollouts.md."""
    slots: PositiveInt = 1
    """Members trained at once; more wait in a queue."""
    gpu_ids: list[Count] | None = None
    """GPUs the campaign may use; default ``0 ..`` as many as the slots need."""
    members_per_gpu: PositiveInt = 1
    """Members trained at once on each GPU (each its own worker): slots ``0 .. k-1`` share the
    first GPUs, and so on. A model that leaves the GPU mostly idle (a 0.5B member uses a few
    percent of an H200's memory bandwidth) trains several members in the time of one; each
    member needs its own memory (the base model once per worker, its adapter, optimizer and
    activations): check the peak a member reports (``peak_memory_gib`` in its result)."""
    mps: bool = True
    """With ``members_per_gpu`` > 1: run the members under a private CUDA MPS daemon, so their
    kernels run side by side instead of time-sliced (8 members of a 0.5B shape on one H200:
    3.60x one at a time under MPS, 1.46x time-sliced). Without ``nvidia-cuda-mps-control`` the
    campaign says so and time-slices."""
    members_per_batch: PositiveInt = 1
    """Members whose rollouts one process samples in ONE batch through its one base model, each
    row through its own member's LoRA adapter with its own temperature and random stream
    (library mode's ``get_actions``; a campaign's long-lived worker takes this many tasks of a
    generation at once and trains them in lock step; the ``hf`` and ``static`` engines, one
    rank, unsharded). A member samples exactly what it samples alone. Eight 0.5B members of 64
    rows are one 512-row batch, which a GPU decodes nearer its large-batch rate than eight
    small batches in turn. 1: members take turns."""
    batched_train: bool = False
    """With ``members_per_batch`` > 1 in a campaign's worker: the members' updates too in one
    forward and one backward a micro-batch (each row through its own member's adapter, each
    member's loss normalised as alone, each optimizer stepping its own adapter), equal to each
    member's own update within float32 rounding rather than bit for bit. false: each member
    learns in turn, exactly as alone (docs/rollouts.md)."""
    lora_kernel: Literal["auto", "segmented", "stacked"] = "auto"
    """How a batch of several members sends each row through its own member's adapter
    (``members_per_batch`` > 1): ``segmented`` runs each member's rows through its own ``A``
    and ``B`` in turn (the operations of a member alone: its rows equal its solo run in
    float32), ``stacked`` every member's ``A`` and ``B`` as one matrix each, masked to the
    row's own member (two matrix products a layer whatever the number of members; equal within
    rounding). On one H200, 8 members of the 0.5B shape decode 40.3k tok/s stacked against
    17.9k segmented (``bench/population_batch.py``). ``auto``: ``stacked`` on a GPU,
    ``segmented`` elsewhere."""
    max_attempts: PositiveInt = 2
    """Attempts of a failing member before it is replaced by a clone of the elite."""
    heartbeat_timeout_s: Seconds = 300.0
    """A member whose heartbeat is older than this is stopped and counted as failed."""
    task_timeout_s: Seconds | None = None
    """The longest one member task may run before it is stopped as ``timeout``; unset: no
    limit."""
    memory_limit_gib: MemoryGiB | None = None
    """The most host memory (GiB) each process of a member may allocate: its heap and private
    mappings (``RLIMIT_DATA``), not GPU memory. Past it an allocation fails, the member is
    recorded as ``out_of_memory`` and retried or replaced, and the machine stays responsive
    for the other members. Unset: no limit."""
    persistent_workers: bool = True
    """Keep one worker group per slot alive for the whole campaign: the base model loads once
    per slot, and the next member costs an adapter, optimizer and RNG load (megabytes, from the
    worker's memory when it trained the parent itself), not a process start and a model load.
    A member that fails takes its worker down; a fresh one serves the next task. ``false``
    starts a process group per member task (isolation, at the price of a model load each)."""
    state_cache_gib: CacheGiB = 8.0
    """Host memory (GiB) each long-lived worker keeps the states of the members it trained in,
    once their checkpoints are written: a child of one of them loads its parent from memory,
    not from disk (the disk copy is written all the same). 0 keeps none. The environment
    variable ``PBT_STATE_CACHE_GIB`` overrides it."""
    device_state_cache_gib: CacheGiB = 0.0
    """Of those states, the most recent ones up to this many GiB also stay on the GPU, so a
    child there loads its parent in one device copy per buffer. Default 0: on an H200 it saved
    a few milliseconds a task, less than the GPU memory is worth to the members. The
    environment variable ``PBT_DEVICE_STATE_CACHE_GIB`` overrides it."""

    @property
    def gpus_needed(self) -> int:
        """GPUs the slots take: ``ceil(slots / members_per_gpu) * gpus_per_member`` (derived)."""
        per = max(1, self.members_per_gpu)
        return -(-self.slots // per) * self.gpus_per_member

    @property
    def ranks(self) -> int:
        """Processes in each member's torchrun group (derived)."""
        return self.gpus_per_member or self.nproc_per_member

    def check(self, prefix: str) -> list[str]:
        problems = bound_problems(self, prefix)
        if self.backend == "slurm":
            problems += self.slurm.check(f"{prefix}.slurm", self)
        else:  # unused until the backend is slurm, but no negative time waits there either
            problems += bound_problems(self.slurm, f"{prefix}.slurm")
        if self.backend == "slurm" and self.gpu_ids is not None:
            problems.append(
                f"{prefix}.gpu_ids ({self.gpu_ids}) is for the local backend; on Slurm the "
                "scheduler gives each job its GPUs: drop gpu_ids"
            )
        if self.backend == "slurm" and self.memory_limit_gib is not None:
            problems.append(
                f"{prefix}.memory_limit_gib ({self.memory_limit_gib}) is for the local backend; "
                f'on Slurm give {prefix}.slurm.mem (per node, e.g. "64G") instead'
            )
        if self.members_per_gpu > 1 and (self.gpus_per_member == 0 or self.backend != "local"):
            problems.append(
                f"{prefix}.members_per_gpu ({self.members_per_gpu}) shares GPUs between the local "
                f"backend's slots; with {'no GPUs' if self.gpus_per_member == 0 else 'Slurm'} "
                "it has nothing to share: leave it at 1"
            )
        if 0 <= self.state_cache_gib < self.device_state_cache_gib:
            problems.append(
                f"{prefix}.device_state_cache_gib ({self.device_state_cache_gib:g}) must be <= "
                f"state_cache_gib ({self.state_cache_gib:g}): a state stays on the GPU only "
                "while it is held in host memory; lower it or raise state_cache_gib"
            )
        if self.gpu_ids is not None and len(self.gpu_ids) < self.gpus_needed:
            problems.append(
                f"{prefix}.gpu_ids has {len(self.gpu_ids)} GPUs but the slots need "
                f"{self.gpus_needed} (slots {self.slots} / members_per_gpu {self.members_per_gpu}"
                f", rounded up, x gpus_per_member {self.gpus_per_member}); list more GPUs or "
                "lower slots"
            )
        return problems


def selection_problems(
    tournament_size: int, elitism: bool, population_size: int, fitness_window: int
) -> list[str]:
    """The rules of tournament selection's arguments, each naming its ``population.`` key."""
    problems = []
    for key, value in (
        ("tournament_size", tournament_size),
        ("population_size", population_size),
        ("fitness_window", fitness_window),
    ):
        if not is_int(value) or value < 1:
            problems.append(
                f"population.{key} ({value!r}) must be an integer >= 1; set {key} to 1 or more"
            )
    if not isinstance(elitism, bool):
        problems.append(f"population.elitism ({elitism!r}) must be true or false; set a boolean")
    if not problems and tournament_size > population_size:
        problems.append(
            f"population.tournament_size ({tournament_size}) must be <= population_size "
            f"({population_size}); lower tournament_size"
        )
    return problems


def truncation_problems(fraction: float, min_gap: float, ready: int = 0) -> list[str]:
    """The rules of truncation selection's arguments, each naming its ``population.`` key."""
    problems = []
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or not (0 < fraction <= 0.5)
    ):
        problems.append(
            f"population.truncation_fraction ({fraction!r}) must be in (0, 0.5]; use 0.25 "
            "(the bottom quarter copies the top quarter)"
        )
    if isinstance(min_gap, bool) or not isinstance(min_gap, int | float) or not min_gap >= 0:
        problems.append(f"population.exploit_gap ({min_gap!r}) must be a number >= 0; use 0")
    if not is_int(ready) or ready < 0:
        problems.append(
            f"population.ready_generations ({ready!r}) must be an integer >= 0; use 0 (no "
            "burn-in) or a few generations"
        )
    return problems


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolved_frequencies(frequencies: list[int] | None, groups: int) -> list[int]:
    """``population.frequencies`` or its default, ``1, 5, 10, ...`` for ``groups`` groups."""
    return list(frequencies) if frequencies else [1] + [5 * i for i in range(1, groups)]


def resolved_brackets(brackets: list[int] | None, group_size: int) -> list[int]:
    """``population.brackets`` or its default for groups of ``group_size``: a quarter winners,
    no survivors, a quarter open to migrants, the rest losers."""
    if brackets:
        return list(brackets)
    winners = opened = round(0.25 * group_size)
    return [winners, 0, opened, group_size - winners - opened]


def multi_frequency_problems(
    size: int, groups: object, frequencies: object, brackets: object
) -> list[str]:
    """The rules of multi-frequency selection, each naming its ``population.`` key."""
    if not is_int(groups) or groups < 2:
        return [
            f"population.subpopulations ({groups!r}) must be an integer >= 2 (migration needs "
            "another group); set subpopulations: 2"
        ]
    if size % groups or size // groups < 3:
        return [
            f"population.size ({size}) must be a multiple of subpopulations ({groups}) with at "
            "least 3 members a group (a winner, an open slot, a loser); set size to "
            f"{3 * groups} or more, a multiple of {groups}"
        ]
    problems = []
    listed = isinstance(frequencies, list | tuple)
    freq = resolved_frequencies(frequencies if listed else None, groups)  # type: ignore[arg-type]
    if frequencies is not None and not listed:
        freq = []
    ok = all(is_int(f) and f >= 1 for f in freq) and len(freq) == groups
    if not ok or any(a >= b for a, b in itertools.pairwise(freq)):
        problems.append(
            f"population.frequencies ({frequencies!r}) must be {groups} strictly increasing "
            f"integers >= 1, one per group; e.g. {resolved_frequencies(None, groups)}"
        )
    group = size // groups
    listed = isinstance(brackets, list | tuple)
    sizes = resolved_brackets(brackets if listed else None, group)  # type: ignore[arg-type]
    if brackets is not None and not listed:
        sizes = []
    ok = len(sizes) == 4 and all(is_int(n) and n >= 0 for n in sizes)
    if not ok or sum(sizes) != group or min(sizes[0], sizes[2], sizes[3]) < 1:  # ok first
        problems.append(
            f"population.brackets ({brackets!r}) must be [winners, survivors, open, losers], "
            f"integers summing to the group size ({group}) with at least one winner, one open "
            f"slot and one loser; e.g. {resolved_brackets(None, group)}"
        )
    return problems
