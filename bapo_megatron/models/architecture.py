"""What the model-family rules read of a policy's architecture.

The architecture is configured as :class:`bapo_megatron.config.ModelConfig` (whose ``model``
section validates it); the rules here depend on its fields only, so this package sits below the
configuration and imports nothing of the package above it.
"""

from __future__ import annotations

from typing import Protocol

from bapo_megatron.models.experts import Experts
from bapo_megatron.models.rope import Llama3Scaling


class Architecture(Protocol):
    """The fields of ``config.ModelConfig`` that the family rules read."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rope_scaling: Llama3Scaling | None
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    moe: Experts | None
    params_dtype: str

    @property
    def is_moe(self) -> bool: ...
