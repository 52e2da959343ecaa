"""The run's configuration: typed dataclasses (one module per group of sections), the presets,
the rules that span sections, and the loader that turns YAML files and dotted overrides into them
(value types are checked in one place, :mod:`bapo_megatron.config.value_types`). A model's HF
``config.json`` is translated by :mod:`bapo_megatron.models.hf_config`."""

from bapo_megatron.config.actor import ActorConfig, OptimizerConfig
from bapo_megatron.config.checks import check_training
from bapo_megatron.config.loading import load_config
from bapo_megatron.config.loss import AGGREGATIONS, CLIP_PRESETS, ClipSearchConfig, LossConfig
from bapo_megatron.config.model import ModelConfig
from bapo_megatron.config.parallel import ParallelConfig
from bapo_megatron.config.rollout import ENGINE_KINDS, RolloutConfig
from bapo_megatron.config.run import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    RewardConfig,
    TrainConfig,
    WarmupConfig,
)
from bapo_megatron.models.hf_config import MODEL_TYPES

__all__ = [
    "AGGREGATIONS",
    "CLIP_PRESETS",
    "ENGINE_KINDS",
    "MODEL_TYPES",
    "ActorConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClipSearchConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "WarmupConfig",
    "check_training",
    "load_config",
]
