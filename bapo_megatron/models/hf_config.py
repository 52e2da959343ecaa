"""The model families' Hugging Face ``config.json``: the tables of what each family has, reading a
config into the fields of ``config.ModelConfig`` (refusing what that model cannot represent
exactly), and writing those fields back out.

The model families are Hugging Face's ``model_type`` names, so they are defined here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from bapo_megatron.models.architecture import Architecture
from bapo_megatron.models.experts import MOE_FAMILY_FIELDS, hf_moe_fields, moe_fields_from_hf
from bapo_megatron.models.rope import hf_rope_fields, rope_fields_from_hf

ModelType = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]

MODEL_TYPES: tuple[str, ...] = get_args(ModelType)
"""The supported families (HF ``model_type``), each with a name map (``models.name_maps``)."""

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""The transformers class of each family (the ``architectures`` entry of its config.json)."""

HEAD_DIM_FAMILIES: tuple[str, ...] = ("qwen3", "qwen3_moe")
"""Families whose ``head_dim`` is a field of its own rather than hidden_size / heads."""

QK_NORM_FAMILIES: tuple[str, ...] = ("qwen3", "qwen3_moe")
"""Families with an RMSNorm of each query and key head (HF ``q_norm`` / ``k_norm``)."""

QKV_BIAS_FAMILIES: tuple[str, ...] = ("qwen2",)
"""Families that always bias q, k and v (and nothing else)."""

O_PROJ_BIAS_FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe")
"""Families whose ``attention_bias`` flag biases o_proj as well as q, k and v."""

MOE_FAMILIES: tuple[str, ...] = tuple(MOE_FAMILY_FIELDS)
"""Families whose sparse layers are experts (they need a ``model.moe`` section)."""

MOE_FIELDS: tuple[str, ...] = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "shared_expert_intermediate_size",
)
"""Mixture-of-experts fields; any of them set (non-zero) describes a model with no dense
equivalent here."""


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
    """The ``ModelConfig`` fields of the HF config ``hf`` (LlamaConfig, Qwen2Config or
    Qwen3Config field names). Anything the model definition cannot represent exactly (a rope
    type other than plain or llama3, sliding-window attention in use, mixture-of-experts fields,
    an MLP or output-projection bias, a head dimension other than hidden/heads outside Qwen3, an
    activation other than SiLU) raises ``ValueError`` naming ``where`` and the field, rather than
    loading a silently different model. Fields present but switched off (``sliding_window``
    with ``use_sliding_window: false``, ``rope_scaling: null``) are accepted."""

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

    rope = rope_fields_from_hf(hf, where)
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "every family here uses a SwiGLU MLP with SiLU")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "the MLP has no bias")
    if hf.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        refuse("layer_types", "only full attention is implemented, in every layer")
    if model_type not in MOE_FAMILIES:
        for key in MOE_FIELDS:
            if hf.get(key):
                refuse(
                    key,
                    f"mixture-of-experts fields in a dense {model_type} config; the experts "
                    f"families are {list(MOE_FAMILIES)}",
                )
    moe = moe_fields_from_hf(hf, model_type, where)
    if model_type in O_PROJ_BIAS_FAMILIES and hf.get("attention_bias"):
        # Their attention_bias puts a bias on o_proj as well; Megatron can bias q/k/v only
        # (add_qkv_bias) or every linear layer including the MLP (add_bias_linear).
        refuse(
            "attention_bias",
            f"{model_type}'s flag also biases o_proj, which has no Megatron equivalent here",
        )
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = hf.get("head_dim")
    if (
        model_type not in HEAD_DIM_FAMILIES
        and head_dim is not None
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
        "head_dim": head_dim,
        "vocab_size": need("vocab_size"),
        **rope,
        "rms_norm_eps": need("rms_norm_eps"),
        "qkv_bias": model_type in QKV_BIAS_FAMILIES,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": need("max_position_embeddings"),
        **({} if moe is None else {"moe": moe}),
    }


def hf_config_fields(model: Architecture) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields of ``model`` (the inverse of
    :func:`model_fields_from_hf`): ``transformers.AutoConfig.for_model(**it)`` builds the
    equivalent ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config``."""
    fields: dict[str, Any] = {
        "model_type": model.model_type,
        "architectures": [ARCHITECTURES[model.model_type]],
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "vocab_size": model.vocab_size,
        **hf_rope_fields(model.rope_theta, model.rope_scaling),
        "rms_norm_eps": model.rms_norm_eps,
        "tie_word_embeddings": model.tie_word_embeddings,
        "max_position_embeddings": model.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": model.params_dtype,
    }
    if model.moe is not None:
        fields.update(hf_moe_fields(model.moe))
    if model.model_type in O_PROJ_BIAS_FAMILIES:
        if model.qkv_bias:
            raise ValueError(
                f"model.qkv_bias=true has no {model.model_type} config.json equivalent (its "
                "attention_bias also biases o_proj)"
            )
        if model.model_type == "llama":
            fields.update(attention_bias=False, mlp_bias=False, head_dim=model.head_dim)
        else:
            fields.update(attention_bias=False, head_dim=model.head_dim)
    elif not model.qkv_bias:
        raise ValueError(
            "model.qkv_bias=false has no Qwen2 config.json equivalent (Qwen2 always biases q/k/v)"
        )
    return fields
