"""The policy's architecture (the ``model`` section)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.config.rope import Llama3RopeScaling
from bapo_megatron.config.value_types import build_dataclass
from bapo_megatron.models.hf_config import (
    HEAD_DIM_FAMILIES,
    MODEL_TYPES,
    MOE_FAMILIES,
    QK_NORM_FAMILIES,
    QKV_BIAS_FAMILIES,
    ModelType,
    hf_config_fields,
    model_fields_from_hf,
    read_hf_config,
)

ParamsDtype = Literal["float32", "bfloat16"]


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's architecture: the dense decoder-only families the paper trains and compares
    with (Qwen2/Qwen2.5, Qwen3 and Llama 3.x), and Qwen3-MoE (Qwen3 with experts, :attr:`moe`).
    All are pre-norm RMSNorm transformers with rotary embeddings, grouped-query attention, a
    SwiGLU MLP (implied, not configurable) and no bias except, for Qwen2, on q/k/v. Qwen3 adds
    an RMSNorm of each query and key head before the rotary embedding (:attr:`qk_layernorm`)
    and sets its head size apart from the hidden size; Llama 3.x scales the rotary frequencies
    (:attr:`rope_scaling`).

    Usually read from a Hugging Face ``config.json`` with :meth:`from_hf_config`.
    """

    model_type: ModelType
    """Hugging Face ``model_type``: `llama` (Llama 2 and 3.x), `qwen2` (Qwen2, Qwen2.5 and the
    DeepSeek-R1-Distill-Qwen models), `qwen3` (the dense Qwen3 models) or `qwen3_moe`
    (Qwen3-30B-A3B, Qwen3-235B-A22B; needs :attr:`moe`)."""
    num_layers: int
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream (HF ``hidden_size``)."""
    ffn_hidden_size: int
    """Width of the SwiGLU MLP, per gate/up projection (HF ``intermediate_size``); in a
    mixture-of-experts model, of the dense layers only (the experts' is in :attr:`moe`)."""
    num_attention_heads: int
    """Query heads (HF ``num_attention_heads``); hidden_size must be a multiple."""
    num_query_groups: int
    """Key/value heads for grouped-query attention (HF ``num_key_value_heads``); equal to
    num_attention_heads for plain multi-head attention, and must divide it."""
    head_dim: int | None = None
    """Channels per attention head (HF ``head_dim``); None: hidden_size / num_attention_heads,
    which Llama and Qwen2 require. Qwen3 sets it on its own (Qwen3-32B: 128 with hidden 5120
    and 64 heads)."""
    vocab_size: int
    """Rows of the embedding and output matrices (HF ``vocab_size``, already padded by the
    checkpoint; not padded again here)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies (HF ``rope_theta``; Qwen2 uses 1e6)."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama 3.x's scaling of the rotary frequencies (HF ``rope_scaling`` / ``rope_parameters``
    with ``rope_type: llama3``); None: plain RoPE."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    qkv_bias: bool | None = None
    """Bias on the q/k/v projections only; None takes the family's: True for Qwen2, False for
    Llama and Qwen3."""
    tie_word_embeddings: bool = False
    """The output layer reuses the input embedding matrix (HF ``tie_word_embeddings``; small
    Qwen2.5 models tie, Llama and larger Qwen2.5 do not)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is run on (HF ``max_position_embeddings``)."""
    moe: MoeConfig | None = None
    """The experts of a mixture-of-experts family (`qwen3_moe`): required there, null for the
    dense families."""
    params_dtype: ParamsDtype = "float32"
    """Dtype of the parameters Megatron allocates: `float32`, or `bfloat16` (Megatron's bf16 mode:
    bf16 parameters and activations, fp32 main weights in the optimizer)."""

    def __post_init__(self) -> None:
        prefix = "model"
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"{prefix}.model_type must be one of {list(MODEL_TYPES)}, got {self.model_type!r}"
            )
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{prefix}.{name} must be a positive integer, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{prefix}.{name} must be a finite number > 0, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"{prefix}.hidden_size ({self.hidden_size}) must be a multiple of "
                    f"{prefix}.num_attention_heads ({self.num_attention_heads})"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        elif self.head_dim < 1:
            raise ValueError(f"{prefix}.head_dim must be a positive integer, got {self.head_dim!r}")
        elif (
            self.model_type not in HEAD_DIM_FAMILIES
            and self.head_dim * self.num_attention_heads != self.hidden_size
        ):
            raise ValueError(
                f"{prefix}.head_dim ({self.head_dim}) must be hidden_size / num_attention_heads "
                f"= {self.hidden_size / self.num_attention_heads:g} for model_type "
                f"{self.model_type!r} (only {list(HEAD_DIM_FAMILIES)} set it apart)"
            )
        if self.qkv_bias is None:
            self.qkv_bias = self.model_type in QKV_BIAS_FAMILIES
        if self.model_type in MOE_FAMILIES:
            if self.moe is None:
                raise ValueError(
                    f"{prefix}.moe is required for model_type {self.model_type!r} (its experts)"
                )
            self.moe.validate(self.num_layers, prefix=f"{prefix}.moe")
        elif self.moe is not None:
            raise ValueError(
                f"{prefix}.moe is set, but model_type {self.model_type!r} is dense; the "
                f"mixture-of-experts families are {list(MOE_FAMILIES)}"
            )
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"{prefix}.params_dtype must be 'float32' or 'bfloat16', got {self.params_dtype!r}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{prefix}.num_query_groups ({self.num_query_groups}) must divide "
                f"{prefix}.num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"{prefix}: the head dimension head_dim = {self.head_dim} must be even for "
                "rotary embeddings"
            )

    @property
    def qk_layernorm(self) -> bool:
        """Whether each query and key head is RMS-normalized before the rotary embedding (HF
        ``q_norm`` / ``k_norm``, Megatron ``q_layernorm`` / ``k_layernorm``): Qwen3's."""
        return self.model_type in QK_NORM_FAMILIES

    @property
    def is_moe(self) -> bool:
        """Whether some layers' MLP is a mixture of experts."""
        return self.moe is not None

    @classmethod
    def from_hf_config(
        cls, source: str | Path | Mapping[str, Any], **overrides: Any
    ) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (LlamaConfig, Qwen2Config or Qwen3Config field
        names).

        ``source`` is the file, the checkpoint folder holding it, or the already parsed mapping;
        ``overrides`` set fields that are not in the file (``params_dtype``) or replace ones that
        are (``max_position_embeddings``). Anything this model definition cannot represent
        exactly raises ``ValueError`` naming the file and the field
        (:func:`~bapo_megatron.models.hf_config.model_fields_from_hf`); the values' types are
        checked as a YAML ``model`` section's are.
        """
        where, hf = read_hf_config(source)
        values = {**model_fields_from_hf(hf, where), **overrides}
        try:
            return build_dataclass(cls, values, prefix="model")
        except ValueError as err:
            raise ValueError(f"HF config {where}: {err}") from None

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` fields of this architecture (the inverse of
        :meth:`from_hf_config`): ``transformers.AutoConfig.for_model(**it)`` builds the
        equivalent ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``."""
        return hf_config_fields(self)
