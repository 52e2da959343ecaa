"""The run's configuration: typed dataclasses (one module per group of sections), the presets,
the translation of a model's HF ``config.json``, and the loader that turns YAML files and dotted
overrides into them (the one place where value types are checked)."""

from bapo_megatron.config.loading import load_config  # after the schema it loads into
from bapo_megatron.config.schema import (
    AGGREGATIONS,
    CLIP_PRESETS,
    ENGINE_KINDS,
    MODEL_TYPES,
    Accelerator,
    ActorConfig,
    AlgorithmConfig,
    CheckpointConfig,
    ClipSearchConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    WarmupConfig,
    validate_layout,
)

__all__ = [
    "AGGREGATIONS", "CLIP_PRESETS", "ENGINE_KINDS", "MODEL_TYPES", "Accelerator", "ActorConfig",
    "AlgorithmConfig", "CheckpointConfig", "ClipSearchConfig", "Config", "DataConfig",
    "LoggingConfig", "LossConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig",
    "RewardConfig", "RolloutConfig", "TrainConfig", "WarmupConfig", "load_config", "validate_layout",
]
