"""The ground floor: typed configuration, the one manifest loader, errors, hyperparameter
ranges and FSDP settings. Imports no torch: the controller reads configs and must start
instantly.

Every command and API loads a manifest through :func:`load_manifest` (a file) or
:func:`manifest_from_dict` (a dict, ``INIT_HP`` included), once.
"""

from pbt.config.algorithm import (
    ALGORITHMS,
    MUTABLE_BY_ALGORITHM,
    MUTABLE_HYPERPARAMETERS,
    RL_ALGORITHMS,
    AlgorithmConfig,
)
from pbt.config.campaign import (
    BudgetConfig,
    LaunchConfig,
    MutationConfig,
    PopulationConfig,
    SearchConfig,
    TrackingConfig,
)
from pbt.config.errors import CheckpointError, ConfigError, PbtError
from pbt.config.fsdp import FSDP_FIELDS, FSDPConfig
from pbt.config.loader import load_manifest, manifest_from_dict
from pbt.config.manifest import SECTIONS, Manifest
from pbt.config.model import LoRAConfig, ModelConfig, OptimConfig, QuantizationConfig
from pbt.config.ranges import HPRange
from pbt.config.rollout import VLLM_FIELDS, RolloutConfig, VLLMConfig
from pbt.config.task import BUILTIN_TASKS, RewardRef, TaskConfig
from pbt.config.training import DistributedConfig, TrainingConfig

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
