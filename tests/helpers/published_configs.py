"""The published ``config.json`` files of tests/data/published_configs (sources in its
README.md), their published parameter totals, and the probe that tells whether this checkout
reads a model family yet."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bapo_megatron.config import ModelConfig
from bapo_megatron.models.name_maps import hf_tensor_shapes, name_map_for

PUBLISHED_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "published_configs"

# Safetensors index total_size / 2 (bf16), see the README beside the files.
PUBLISHED_PARAMETERS = {
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-32B": 32_763_876_352,
    "DeepSeek-R1-Distill-Qwen-7B": 7_615_616_512,
    "DeepSeek-R1-Distill-Qwen-32B": 32_763_876_352,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-32B": 32_762_123_264,
    "Llama-3.2-3B": 3_212_749_824,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Qwen3-235B-A22B": 235_093_634_560,
}

# The mixture-of-experts models' activated parameters per token as their model cards state them
# ("30.5B in total and 3.3B activated", "235B in total and 22B activated"): (value, the unit it is
# truncated to).
PUBLISHED_ACTIVE_PARAMETERS = {
    "Qwen3-30B-A3B": (3.3e9, 0.1e9),
    "Qwen3-235B-A22B": (22e9, 1e9),
}


def config_path(name: str) -> Path:
    """The published config.json of ``name`` (a key of :data:`PUBLISHED_PARAMETERS`)."""
    return PUBLISHED_CONFIGS / f"{name}.json"


def published_config(name: str) -> dict[str, Any]:
    """The parsed published config.json of ``name``."""
    return json.loads(config_path(name).read_text())


def unsupported_reason(name: str) -> str | None:
    """Why this checkout cannot read ``name`` yet, or None when it can. Only the two refusals
    of families that are being added (``model_type 'qwen3' is not supported`` and Llama 3's
    ``rope_scaling``) count as "not yet"; any other error is a real failure and is raised."""
    try:
        ModelConfig.from_hf_config(config_path(name))
    except ValueError as err:
        text = str(err)
        if "model_type 'qwen3' is not supported" in text or (
            "rope_scaling" in text and "llama3" in text
        ):
            return f"{name}: this checkout does not read the family yet ({text})"
        raise
    return None


def skip_unless_supported(name: str):
    """A ``pytest.mark.skipif`` that skips only while :func:`unsupported_reason` says so."""
    reason = unsupported_reason(name)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def parameter_count(model: ModelConfig) -> int:
    """Parameters of the whole model as HF stores them: every tensor of the family's name map
    (embedding, every layer's projections, biases and norms, the final norm, and the output
    layer unless it is tied to the embedding)."""
    shapes = name_map_for(model.model_type).hf_shapes(model)
    return sum(math.prod(shape) for shape in shapes.values())


def active_parameter_count(model: ModelConfig) -> int:
    """Parameters one token passes through: every tensor of the name map except the experts,
    plus ``num_experts_per_tok`` experts of each MoE layer (embedding and output layer counted,
    as the model cards count them)."""
    total = 0
    for rule in name_map_for(model.model_type).rules(model):
        if not rule.exported:
            continue
        size = sum(math.prod(shape) for shape in hf_tensor_shapes(rule, model))
        if rule.expert is None:
            total += size
        elif rule.expert < model.moe.num_experts_per_tok:  # all experts have the same size
            total += size
    return total
