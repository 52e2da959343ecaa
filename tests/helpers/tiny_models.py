"""The tiny dense model most tests build: the tiny CPU run's layer shape (examples/tiny_cpu: 2
layers, hidden size 64, MLP 128, 4 attention heads in 2 query groups), a llama of 128 tokens
unless a test says otherwise. A test that needs another shape writes its own."""

from __future__ import annotations

from bapo_megatron.config import ModelConfig

TINY_MODEL = {
    "model_type": "llama",
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "vocab_size": 128,
}
"""The model section's fields of the tiny model."""


def tiny_model(**fields) -> ModelConfig:
    """The tiny model, ``fields`` set or overridden."""
    return ModelConfig(**{**TINY_MODEL, **fields})


def tiny_model_overrides(**fields) -> list[str]:
    """The tiny model as dotted overrides of a run's configuration (``model.hidden_size=64``...),
    ``fields`` set or overridden."""
    return [f"model.{name}={value}" for name, value in {**TINY_MODEL, **fields}.items()]
