"""The ground floor: typed configuration, the one manifest loader, errors, hyperparameter
ranges and FSDP settings. Imports no torch: the controller reads configs and must start
instantly.

Every command and API loads a manifest through :func:`load_manifest` (a file) or
:func:`manifest_from_dict` (a dict, ``INIT_HP`` included), once.

The folder, by concept: :mod:`.sections` (one dataclass per manifest section and the rules of
its own values), :mod:`.manifest` (the sections composed, and the rules across them),
:mod:`.read` (the strict YAML parser, the loader, environment overrides and the canonical form
that crosses process boundaries), :mod:`.agilerl` (AgileRL's formats, translated once),
:mod:`.ranges` (hyperparameter ranges), :mod:`.rules` (the value rules sections share),
:mod:`.errors` (the exceptions users see) and :mod:`.gguf` (GGUF headers and the model cache).
Everything a caller needs is exported here.
"""

from pbt.config.errors import CheckpointError, ConfigError, PbtError
from pbt.config.manifest import SECTIONS, Manifest
from pbt.config.ranges import HPRange
from pbt.config.read.loader import load_manifest, manifest_from_dict
from pbt.config.sections.algorithm import (
    ALGORITHMS,
    MUTABLE_BY_ALGORITHM,
    MUTABLE_HYPERPARAMETERS,
    RL_ALGORITHMS,
    AlgorithmConfig,
)
from pbt.config.sections.campaign import (
    BudgetConfig,
    LaunchConfig,
    MutationConfig,
    PopulationConfig,
    SearchConfig,
    TrackingConfig,
)
from pbt.config.sections.fsdp import FSDP_FIELDS, FSDPConfig
from pbt.config.sections.model import LoRAConfig, ModelConfig, OptimConfig, QuantizationConfig
from pbt.config.sections.rollout import VLLM_FIELDS, RolloutConfig, VLLMConfig
from pbt.config.sections.task import BUILTIN_TASKS, RewardRef, TaskConfig
from pbt.config.sections.training import DistributedConfig, TrainingConfig

__all__ = [
    "ALGORITHMS",
    "BUILTIN_TASKS",
    "FSDP_FIELDS",
    "MUTABLE_BY_ALGORITHM",
    "MUTABLE_HYPERPARAMETERS",
    "RL_ALGORITHMS",
    "SECTIONS",
    "VLLM_FIELDS",
    "AlgorithmConfig",
    "BudgetConfig",
    "CheckpointError",
    "ConfigError",
    "DistributedConfig",
    "FSDPConfig",
    "HPRange",
    "LaunchConfig",
    "LoRAConfig",
    "Manifest",
    "ModelConfig",
    "MutationConfig",
    "OptimConfig",
    "PbtError",
    "PopulationConfig",
    "QuantizationConfig",
    "RewardRef",
    "RolloutConfig",
    "SearchConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainingConfig",
    "VLLMConfig",
    "load_manifest",
    "manifest_from_dict",
]
