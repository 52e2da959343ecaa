"""The Hugging Face ``config.json`` form of a policy architecture: reading one into the fields of
:class:`~bapo_megatron.config.model.ModelConfig` (refusing what that model cannot represent
exactly), and writing those fields back out.

The model families are Hugging Face's ``model_type`` names, so they are defined here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: model.py imports this module
    from bapo_megatron.config.model import ModelConfig

ModelType = Literal["llama", "qwen2"]

MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2")


def read_hf_config(source: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(where, fields)`` of an HF ``config.json``: ``source`` is the file, the checkpoint folder
    holding it, or the already parsed mapping; ``where`` names it in error messages."""
    if isinstance(source, Mapping):
        return "<config mapping>", dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    where = str(path)
    if not path.is_file():
        raise ValueError(f"HF config {where} does not exist")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"HF config {where} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"HF config {where}: expected a JSON object at the top level")  # noqa: TRY004
    return where, hf


def model_fields_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of the HF config ``hf`` (LlamaConfig or Qwen2Config field
    names). Anything the model definition cannot represent exactly (rope scaling, sliding-window
    attention, an MLP or output-projection bias, a head dimension other than hidden/heads, an
    activation other than SiLU) raises ``ValueError`` naming ``where`` and the field, rather than
    loading a silently different model."""

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise ValueError(f"HF config {where}: required field {key!r} is missing")
        return hf[key]

    model_type = need("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"HF config {where}: model_type {model_type!r} is not supported; "
            f"supported: {list(MODEL_TYPES)}"
        )

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"HF config {where}: {key}={hf[key]!r} is not supported ({why})")

    if hf.get("rope_scaling") is not None:
        refuse("rope_scaling", "only plain RoPE with rope_theta is implemented")
    # transformers >= 5 writes the RoPE base (and any scaling) inside rope_parameters.
    rope = hf.get("rope_parameters")
    rope_theta = hf.get("rope_theta")
    if isinstance(rope, Mapping):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"HF config {where}: rope_parameters.rope_type={rope_type!r} is not "
                "supported (only plain RoPE with rope_theta is implemented)"
            )
        nested = rope.get("rope_theta")
        if nested is not None and rope_theta is not None and nested != rope_theta:
            raise ValueError(
                f"HF config {where}: rope_theta={rope_theta!r} and "
                f"rope_parameters.rope_theta={nested!r} disagree"
            )
        rope_theta = nested if nested is not None else rope_theta
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "both families use a SwiGLU MLP with SiLU")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "the MLP has no bias")
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    if model_type == "llama" and hf.get("attention_bias"):
        # Llama's attention_bias puts a bias on o_proj as well; Megatron can bias q/k/v only
        # (add_qkv_bias) or every linear layer including the MLP (add_bias_linear).
        refuse(
            "attention_bias",
            "Llama's flag also biases o_proj, which has no Megatron equivalent here",
        )
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = hf.get("head_dim")
    if (
        head_dim is not None
        and isinstance(hidden, int)
        and isinstance(heads, int)
        and heads > 0
        and head_dim != hidden // heads
    ):
        refuse("head_dim", f"must equal hidden_size / num_attention_heads = {hidden // heads}")

    return {
        "model_type": model_type,
        "num_layers": need("num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": need("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,  # absent in old MHA configs
        "vocab_size": need("vocab_size"),
        "rope_theta": 10000.0 if rope_theta is None else rope_theta,
        "rms_norm_eps": need("rms_norm_eps"),
        "qkv_bias": model_type == "qwen2",
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": need("max_position_embeddings"),
    }


def hf_config_fields(model: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields of ``model`` (the inverse of
    :func:`model_fields_from_hf`): ``transformers.AutoConfig.for_model(**it)`` builds the
    equivalent ``LlamaConfig`` / ``Qwen2Config``."""
    fields: dict[str, Any] = {
        "model_type": model.model_type,
        "architectures": [
            "LlamaForCausalLM" if model.model_type == "llama" else "Qwen2ForCausalLM"
        ],
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "vocab_size": model.vocab_size,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": model.params_dtype,
    }
    if model.model_type == "llama":
        fields.update(attention_bias=False, mlp_bias=False, head_dim=model.head_dim)
    elif not model.qkv_bias:
        raise ValueError(
            "model.qkv_bias=false has no Qwen2 config.json equivalent (Qwen2 always biases q/k/v)"
        )
    return fields
