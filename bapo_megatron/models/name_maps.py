"""Hugging Face <-> Megatron-Core parameter names and layouts: one name map per model family.

The registry :data:`NAME_MAPS` is keyed by the HF ``model_type`` (no substring dispatch). A name
map turns a model's architecture (``config.ModelConfig``) into :class:`ParamRule`\\ s, one per
Megatron parameter of the whole (TP1/PP1) model, and every rule says

- which HF tensors make the Megatron tensor and how (:func:`merge`, inverse :func:`split`):
  ``same`` (one tensor, unchanged), ``qkv`` or ``gate_up``;
- along which dimension tensor-parallel rank ``r`` of ``t`` holds the contiguous slice ``r`` of
  *each HF tensor* (:func:`tp_slice`), or None for replicated tensors (norms).

The Megatron layouts, and why TP slicing is done on the HF side:

- ``linear_qkv.weight`` is ``[G * (H/G + 2) * d, hidden]`` for H query heads in G query groups of
  head size d, laid out per group as ``(q heads of the group, k, v)``; its bias likewise. TP splits
  along the groups, so rank r holds groups ``[r G/t, (r+1) G/t)``: the contiguous slices r of q, k
  and v, merged group by group. ``merge`` of the slices is the rank's shard.
- ``linear_fc1.weight`` (SwiGLU) is ``[gate; up]``, ``[2 F, hidden]``; rank r holds
  ``[gate_r; up_r]``: again ``merge`` of the slices r.
- Column-parallel matrices (embedding, output layer) split dim 0, row-parallel ones
  (``linear_proj``, ``linear_fc2``) dim 1: the same dimension in HF, whose ``nn.Linear`` weights are
  ``[out, in]`` as Megatron's.

So a rank's shard of every parameter is ``merge(tp_slice(hf) for each hf tensor)``, and the whole
HF tensor is the concatenation over ranks of ``split(shard)`` along ``tp_dim``: the offline
conversion, the live export and the tests all use exactly these functions.

Mixture-of-experts layers (Qwen3-MoE) replace the MLP's two rules with the router
(``mlp.router.weight`` <- ``mlp.gate.weight``) and, per expert e, Megatron's ``SequentialMLP``
weights ``mlp.experts.local_experts.{e}.linear_fc1/fc2.weight`` <- the per-expert names HF writes
on disk (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``). Expert numbers in these rules are
global (the EP1 model). An expert's matrices are split by *expert* tensor parallelism
(``parallel.expert_tensor_parallel_size``), not by tensor parallelism: ``tp_dim`` of an expert
rule (``ParamRule.expert`` set) is along the expert-TP group, fc1 by rows ([gate_r; up_r]) and
fc2 by columns as the dense MLP's.

With tied embeddings the last pipeline stage of a PP > 1 model holds ``output_layer.weight``, a
copy of the embedding matrix: it is loaded from ``model.embed_tokens.weight`` and never exported
(``ParamRule.exported``). HF checkpoints of tied models usually carry no ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from bapo_megatron.models.architecture import Architecture

Layout = Literal["same", "qkv", "gate_up"]


@dataclass(frozen=True)
class ParamRule:
    """How one Megatron parameter of the whole model is made of HF tensors."""

    megatron: str
    """Megatron name in the whole model (global layer numbers), e.g.
    ``decoder.layers.3.self_attention.linear_qkv.weight``."""
    hf: tuple[str, ...]
    """HF names of the tensors merged into it, in merge order (q, k, v / gate, up)."""
    layout: Layout
    """`same`: the one HF tensor as it is; `qkv`: q, k, v interleaved per query group;
    `gate_up`: gate and up stacked."""
    tp_dim: int | None
    """Dimension along which TP ranks hold contiguous equal slices of each HF tensor (and of the
    Megatron tensor); None: every rank holds the whole tensor."""
    exported: bool = True
    """False for the tied output layer: a copy of the embedding that HF does not store."""
    expert: int | None = None
    """Global index of the expert this parameter belongs to; None for every other parameter
    (the expert-parallel rank holding expert e is e // (num_experts / EP))."""


# Per-layer entries: (Megatron suffix, HF suffixes, layout, tp_dim). Prefixes are added by
# NameMap.rules: "decoder.layers.{i}." and "model.layers.{i}.".
_LayerEntry = tuple[str, tuple[str, ...], Layout, int | None]

_LLAMA_LAYER: tuple[_LayerEntry, ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "same", None),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
        0,
    ),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "same", 1),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "same", None),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "same", 1),
)

# Qwen2 / Qwen2.5: Llama's layer plus a bias on q, k and v (and nothing else).
_QWEN2_LAYER: tuple[_LayerEntry, ...] = (
    _LLAMA_LAYER[:2]
    + (
        (
            "self_attention.linear_qkv.bias",
            ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
            "qkv",
            0,
        ),
    )
    + _LLAMA_LAYER[2:]
)

# Qwen3: Llama's layer plus an RMSNorm of each query and key head (weights of head_dim, shared by
# the heads, so every TP rank holds them whole), after the projections as in HF.
_QWEN3_LAYER: tuple[_LayerEntry, ...] = (
    _LLAMA_LAYER[:3]
    + (
        ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), "same", None),
        ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), "same", None),
    )
    + _LLAMA_LAYER[3:]
)

# Qwen3-MoE: Qwen3's attention and norms; the MLP entries of a sparse layer are built per expert
# by _moe_mlp_rules.
_QWEN3_MOE_ATTENTION = _QWEN3_LAYER[:-2]
_EXPERT_PREFIX = "mlp.experts.local_experts."


def _moe_mlp_rules(megatron_prefix: str, hf_prefix: str, num_experts: int) -> list[ParamRule]:
    """The router and per-expert rules of one sparse layer (global expert numbers)."""
    rules = [
        ParamRule(
            f"{megatron_prefix}mlp.router.weight", (f"{hf_prefix}mlp.gate.weight",), "same", None
        )
    ]
    for e in range(num_experts):
        hf = f"{hf_prefix}mlp.experts.{e}."
        megatron = f"{megatron_prefix}{_EXPERT_PREFIX}{e}."
        rules += [
            ParamRule(
                megatron + "linear_fc1.weight",
                (hf + "gate_proj.weight", hf + "up_proj.weight"),
                "gate_up",
                0,  # along the expert tensor-parallel group
                expert=e,
            ),
            ParamRule(
                megatron + "linear_fc2.weight", (hf + "down_proj.weight",), "same", 1, expert=e
            ),
        ]
    return rules


# Transformer Engine's fused layers own the pre-norm weights; the local spec (CPU) has separate
# norm modules. Megatron's own checkpoints use the TE names as keys for both.
TE_NAME_ALIASES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclass(frozen=True)
class NameMap:
    """The name map of one model family (an HF ``model_type``)."""

    model_type: str
    """HF ``model_type`` this map is registered under."""
    layer: tuple[_LayerEntry, ...]
    """The decoder layer's parameters, in HF order (of a dense layer, for an MoE family)."""
    moe_layer: tuple[_LayerEntry, ...] | None = None
    """An MoE family's sparse layer without its MLP (router and experts are added per expert);
    None for dense families."""

    def rules(self, model: Architecture) -> list[ParamRule]:
        """Every Megatron parameter of the whole ``model``, in HF order: embedding, layers, final
        norm, output layer (untied; tied: the loading-only copy of the embedding)."""
        if model.model_type != self.model_type:
            raise ValueError(
                f"name map {self.model_type!r} cannot describe a model of "
                f"model_type {model.model_type!r}"
            )
        has_bias = any(m.endswith(".bias") for m, *_ in self.layer)
        if model.qkv_bias != has_bias:
            raise ValueError(
                f"model.qkv_bias={model.qkv_bias} does not match the "
                f"{self.model_type!r} family (q/k/v bias: {has_bias})"
            )
        rules = [
            ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "same", 0)
        ]
        if (self.moe_layer is not None) != model.is_moe:
            raise ValueError(
                f"name map {self.model_type!r}: model.moe must be "
                f"{'set' if self.moe_layer is not None else 'null'}"
            )
        sparse = (
            model.moe.moe_layer_pattern(model.num_layers)
            if model.moe is not None
            else [False] * model.num_layers
        )
        for i in range(model.num_layers):
            rules += [
                ParamRule(
                    f"decoder.layers.{i}.{megatron}",
                    tuple(f"model.layers.{i}.{name}" for name in hf),
                    layout,
                    tp_dim,
                )
                for megatron, hf, layout, tp_dim in (self.moe_layer if sparse[i] else self.layer)
            ]
            if sparse[i]:
                rules += _moe_mlp_rules(
                    f"decoder.layers.{i}.", f"model.layers.{i}.", model.moe.num_experts
                )
        rules.append(
            ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "same", None)
        )
        if model.tie_word_embeddings:
            rules.append(
                ParamRule(
                    "output_layer.weight", ("model.embed_tokens.weight",), "same", 0, exported=False
                )
            )
        else:
            rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "same", 0))
        return rules

    def hf_shapes(self, model: Architecture) -> dict[str, tuple[int, ...]]:
        """Shape of every HF tensor of ``model`` (without ``lm_head.weight`` when tied)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for rule in self.rules(model):
            if rule.exported:
                shapes.update(zip(rule.hf, hf_tensor_shapes(rule, model)))
        return shapes


NAME_MAPS: dict[str, NameMap] = {
    "llama": NameMap("llama", _LLAMA_LAYER),
    "qwen2": NameMap("qwen2", _QWEN2_LAYER),
    "qwen3": NameMap("qwen3", _QWEN3_LAYER),
    "qwen3_moe": NameMap("qwen3_moe", _QWEN3_LAYER, moe_layer=_QWEN3_MOE_ATTENTION),
}
"""The registry: HF ``model_type`` -> its family's name map."""


def name_map_for(model_type: str) -> NameMap:
    """The registered name map of ``model_type``; ``ValueError`` listing the supported ones."""
    if model_type not in NAME_MAPS:
        raise ValueError(
            f"no name map for HF model_type {model_type!r}; supported: {sorted(NAME_MAPS)}"
        )
    return NAME_MAPS[model_type]


def hf_tensor_shapes(rule: ParamRule, model: Architecture) -> tuple[tuple[int, ...], ...]:
    """Shapes of the whole HF tensors of ``rule`` for ``model``."""
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    suffix = (
        rule.megatron.split(".", 3)[-1]
        if rule.megatron.startswith("decoder.layers.")
        else rule.megatron
    )
    if rule.expert is not None:  # drop the expert number: every expert has the same shapes
        suffix = "expert." + suffix.rsplit(".", 2)[-2]
    moe = model.moe
    shapes = {
        "embedding.word_embeddings.weight": ((model.vocab_size, h),),
        "output_layer.weight": ((model.vocab_size, h),),
        "decoder.final_layernorm.weight": ((h,),),
        "input_layernorm.weight": ((h,),),
        "pre_mlp_layernorm.weight": ((h,),),
        "self_attention.q_layernorm.weight": ((d,),),
        "self_attention.k_layernorm.weight": ((d,),),
        "self_attention.linear_qkv.weight": ((q, h), (kv, h), (kv, h)),
        "self_attention.linear_qkv.bias": ((q,), (kv,), (kv,)),
        "self_attention.linear_proj.weight": ((h, q),),
        "mlp.linear_fc1.weight": ((model.ffn_hidden_size, h),) * 2,
        "mlp.linear_fc2.weight": ((h, model.ffn_hidden_size),),
    }
    if moe is not None:
        shapes.update(
            {
                "mlp.router.weight": ((moe.num_experts, h),),
                "expert.linear_fc1": ((moe.moe_intermediate_size, h),) * 2,
                "expert.linear_fc2": ((h, moe.moe_intermediate_size),),
            }
        )
    return shapes[suffix]


def megatron_shape(rule: ParamRule, model: Architecture, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of the Megatron parameter of ``rule`` on one of ``tp_size`` ranks."""
    parts = [list(shape) for shape in hf_tensor_shapes(rule, model)]
    if rule.tp_dim is not None:
        for shape in parts:
            shape[rule.tp_dim] //= tp_size
    if rule.layout == "same":
        return tuple(parts[0])
    return (sum(shape[0] for shape in parts), *parts[0][1:])


def tp_slice(rule: ParamRule, length: int, tp_rank: int, tp_size: int) -> slice:
    """The slice of an HF tensor's ``rule.tp_dim`` (of size ``length``) that ``tp_rank`` holds."""
    if rule.tp_dim is None:
        return slice(0, length)
    if length % tp_size:
        raise ValueError(
            f"{rule.hf}: dimension {rule.tp_dim} of size {length} is not divisible "
            f"by the tensor-parallel size {tp_size}"
        )
    step = length // tp_size
    return slice(tp_rank * step, (tp_rank + 1) * step)


def merge(rule: ParamRule, parts: Sequence[torch.Tensor], model: Architecture) -> torch.Tensor:
    """The Megatron tensor made of the HF tensors ``parts`` (whole tensors, or one rank's
    :func:`tp_slice` of each, which gives that rank's shard)."""
    if len(parts) != len(rule.hf):
        raise ValueError(
            f"{rule.megatron}: expected {len(rule.hf)} tensors {rule.hf}, got {len(parts)}"
        )
    if rule.layout == "same":
        return parts[0]
    if rule.layout == "gate_up":
        return torch.cat(list(parts), dim=0)
    q, k, v = parts
    d = model.head_dim
    groups = k.shape[0] // d  # query groups in these slices
    rest = q.shape[1:]
    # [G, heads_per_group * d | d | d, *rest] -> [G * (heads_per_group + 2) * d, *rest]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
        dim=1,
    ).reshape(-1, *rest)


def split(rule: ParamRule, tensor: torch.Tensor, model: Architecture) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`merge`: the HF tensors (or slices) that make ``tensor``. Views where the
    layout allows (``same``, ``gate_up``); ``qkv`` pieces are strided views too."""
    if rule.layout == "same":
        return (tensor,)
    if rule.layout == "gate_up":
        return tuple(tensor.chunk(2, dim=0))
    d = model.head_dim
    per_group = model.num_attention_heads // model.num_query_groups
    rest = tensor.shape[1:]
    grouped = tensor.reshape(-1, per_group + 2, d, *rest)  # [G, q heads + k + v, d, *rest]
    return (
        grouped[:, :per_group].reshape(-1, *rest),
        grouped[:, per_group].reshape(-1, *rest),
        grouped[:, per_group + 1].reshape(-1, *rest),
    )


def place_shard(
    rule: ParamRule,
    wholes: Sequence[torch.Tensor],
    shard: torch.Tensor,
    tp_rank: int,
    model: Architecture,
) -> None:
    """Copy TP rank ``tp_rank``'s Megatron ``shard`` of ``rule`` into its place in the whole HF
    tensors ``wholes``: the slice ``tp_rank`` of ``tp_dim`` (the whole tensor when replicated),
    the inverse of :func:`tp_slice` + :func:`merge`. q/k/v are copied group by group through
    views, without the intermediate copies :func:`split` makes of them."""
    if rule.layout == "qkv":
        d = model.head_dim
        per_group = model.num_attention_heads // model.num_query_groups
        rest = shard.shape[1:]
        grouped = shard.view(-1, per_group + 2, d, *rest)  # [G_local, q heads + k + v, d, ...]
        groups = grouped.shape[0]
        sources = (grouped[:, :per_group], grouped[:, per_group], grouped[:, per_group + 1])
        for target, source in zip(wholes, sources):  # tp_dim 0: a contiguous block of rows
            rows = target.shape[0] * groups // model.num_query_groups
            target.narrow(0, tp_rank * rows, rows).view(source.shape).copy_(source)
        return
    for target, part in zip(wholes, split(rule, shard, model)):
        if rule.tp_dim is None:
            target.copy_(part)
        else:
            step = part.shape[rule.tp_dim]
            target.narrow(rule.tp_dim, tp_rank * step, step).copy_(part)


def chunk_parameters(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(whole-model Megatron name, parameter)`` for every parameter of a model chunk (or a
    wrapper with ``.module``, such as DDP): decoder layers renumbered by their global
    ``layer_number``, the experts of an expert-parallel rank by their global index,
    Transformer Engine's norm names mapped to the local spec's."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    layers = chunk.decoder.layers
    for name, param in chunk.named_parameters():
        parts = name.split(".", 3)
        if parts[:2] == ["decoder", "layers"]:
            layer = layers[int(parts[2])]
            suffix = TE_NAME_ALIASES.get(parts[3], parts[3])
            if suffix.startswith(_EXPERT_PREFIX):
                local, rest = suffix[len(_EXPERT_PREFIX) :].split(".", 1)
                suffix = f"{_EXPERT_PREFIX}{layer.mlp.local_expert_indices[int(local)]}.{rest}"
            name = f"decoder.layers.{layer.layer_number - 1}.{suffix}"
        yield name, param
