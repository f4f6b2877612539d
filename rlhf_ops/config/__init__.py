"""Typed run configuration: schema, presets + dotted overrides, validation, batch plan."""

from rlhf_ops.config.batch_plan import (
    BatchPlan,
    ForwardPlan,
    MeshPlan,
    PPOPlan,
    derive_batch_plan,
    total_training_steps,
)
from rlhf_ops.config.errors import ConfigError, ConfigProblem
from rlhf_ops.config.loader import apply_overrides, build_config, dump_config, list_presets, load_config, read_preset
from rlhf_ops.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    FSDPConfig,
    ModelConfig,
    RefConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrackingConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "BatchPlan",
    "ConfigError",
    "ConfigProblem",
    "CriticConfig",
    "DataConfig",
    "ForwardPlan",
    "FSDPConfig",
    "MeshPlan",
    "ModelConfig",
    "PPOPlan",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrackingConfig",
    "TrainerConfig",
    "apply_overrides",
    "build_config",
    "derive_batch_plan",
    "dump_config",
    "total_training_steps",
    "list_presets",
    "load_config",
    "read_preset",
]
