"""An engine worker's shard map: which HF elements each of vLLM's tensor-parallel workers holds,
from a description of how vLLM's layers split each weight.

The description (:data:`VLLM_LAYER`, :data:`VLLM_TOP`) names, per HF tensor, vLLM's parameter and
its kind of split:

- ``column``-like fused parameters: ``qkv`` (``QKVParallelLinear``: the rank's query heads, then
  its key heads, then its value heads; with fewer key/value heads than ranks each head is held by
  ``tp / kv_heads`` consecutive ranks) and ``merged`` (``MergedColumnParallelLinear``: the rank's
  gate rows, then its up rows);
- ``row`` (``RowParallelLinear``: a block of columns);
- ``vocab`` (``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple
  of 64, then split into blocks of rows; padding rows are fills);
- ``replicated`` (norms, the experts' router);
- ``w13`` / ``w2`` (``FusedMoE`` without expert parallelism: every worker holds every expert,
  ``w13 [E, 2 I / tp, H]`` its gate then up rows, ``w2 [E, H, I / tp]`` a block of columns; the
  parameters of its ``routed_experts`` submodule).

Only the description is vLLM-specific; what it gives is the same :class:`ShardMap` as the
trainer's, so a map derived another way (from vLLM's own loaders) can take its place.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from bapo_megatron.models.architecture import Architecture
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.shard_map import Fill, Region, ShardMap, matrix_shape

VOCAB_PADDING = 64
"""vLLM pads the vocabulary of its embedding and output layer to a multiple of this."""

VLLM_LAYER: dict[str, tuple[str, str, int]] = {
    "input_layernorm.weight": ("input_layernorm.weight", "replicated", 0),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", "replicated", 0),
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight", "replicated", 0),
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight", "replicated", 0),
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", "qkv", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", "qkv", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", "qkv", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", "qkv", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", "qkv", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", "qkv", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", "row", 0),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "merged", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "merged", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", "row", 0),
    "mlp.gate.weight": ("mlp.gate.weight", "replicated", 0),
}
"""HF suffix of a decoder layer's tensor -> (vLLM parameter suffix, kind, part)."""

VLLM_TOP: dict[str, tuple[str, str, int]] = {
    "model.embed_tokens.weight": ("model.embed_tokens.weight", "vocab", 0),
    "lm_head.weight": ("lm_head.weight", "vocab", 0),
    "model.norm.weight": ("model.norm.weight", "replicated", 0),
}
"""HF tensors outside the decoder layers -> (vLLM parameter, kind, part)."""

_LAYER = re.compile(r"^(?P<prefix>model\.layers\.\d+\.)(?P<suffix>.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def vllm_shard_map(model: Architecture, tp_rank: int, tp_size: int, rank: int) -> ShardMap:
    """The shard map of vLLM's tensor-parallel worker ``tp_rank`` of ``tp_size``, as ``rank`` of
    the weight group. ``ValueError`` for a split vLLM refuses or a tensor not described."""
    heads, groups = model.num_attention_heads, model.num_query_groups
    if heads % tp_size or (groups % tp_size and tp_size % groups):
        raise ValueError(
            f"vLLM cannot split {heads} query heads and {groups} key/value heads over "
            f"{tp_size} tensor-parallel workers"
        )
    regions: list[Region] = []
    fills: dict[str, Fill] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    split = _Split(model, tp_rank, tp_size)
    for hf, shape in name_map_for(model.model_type).hf_shapes(model).items():
        local, kind, part, expert = _describe(hf)
        for piece in split.parts(hf, tuple(shape), local, kind, part, expert, shapes):
            if isinstance(piece, Fill):
                fills[piece.local] = piece
            else:
                regions.append(piece)
    return ShardMap(rank, tuple(regions), tuple(fills.values()), tuple(shapes.items()))


def _describe(hf: str) -> tuple[str, str, int, int | None]:
    """``(vLLM parameter, kind, part, expert)`` of the HF tensor ``hf``."""
    if hf in VLLM_TOP:
        return (*VLLM_TOP[hf], None)
    found = _LAYER.match(hf)
    if found:
        prefix, suffix = found["prefix"], found["suffix"]
        if suffix in VLLM_LAYER:
            local, kind, part = VLLM_LAYER[suffix]
            return prefix + local, kind, part, None
        expert = _EXPERT.match(suffix)
        if expert:
            proj = expert["proj"]
            # vLLM 0.32 keeps FusedMoE's weights in its `routed_experts` submodule
            local = (
                prefix
                + "mlp.experts.routed_experts."
                + ("w2_weight" if proj == "down" else "w13_weight")
            )
            kind = "w2" if proj == "down" else "w13"
            return local, kind, int(proj == "up"), int(expert["expert"])
    raise ValueError(f"vLLM shard map: no description of how vLLM splits {hf!r}")


class _Split:
    """The regions of one HF tensor on one worker, per kind."""

    def __init__(self, model: Architecture, rank: int, size: int) -> None:
        self.model, self.rank, self.size = model, rank, size
        d = model.head_dim
        self.q_rows = model.num_attention_heads // size * d
        self.kv_heads = max(1, model.num_query_groups // size)
        self.kv_rows = self.kv_heads * d

    def parts(
        self,
        hf: str,
        hf_shape: tuple[int, ...],
        local: str,
        kind: str,
        part: int,
        expert: int | None,
        shapes: dict[str, tuple[int, ...]],
    ) -> Iterator[Region | Fill]:
        (rows, cols), r, t = matrix_shape(hf_shape), self.rank, self.size
        if kind == "replicated":
            shapes[local] = hf_shape
            yield Region(hf, 0, 0, rows, cols, local, 0, cols, replicated=t > 1)
        elif kind == "qkv":
            yield from self._qkv(hf, len(hf_shape), cols, local, part, shapes)
        elif kind == "merged":
            step = rows // t
            shapes[local] = (2 * step, cols)
            yield Region(hf, r * step, 0, step, cols, local, part * step * cols, cols)
        elif kind == "row":
            step = cols // t
            shapes[local] = (rows, step)
            yield Region(hf, 0, r * step, rows, step, local, 0, step)
        elif kind == "vocab":
            padded = -(-rows // VOCAB_PADDING) * VOCAB_PADDING
            if padded % t:
                raise ValueError(f"{hf}: {padded} padded vocabulary rows over {t} workers")
            per_rank = padded // t
            shapes[local] = (per_rank, cols)
            held = max(0, min(rows, (r + 1) * per_rank) - r * per_rank)
            if held:
                yield Region(hf, r * per_rank, 0, held, cols, local, 0, cols)
            if held < per_rank:
                yield Fill(local, held * cols, per_rank - held, cols, cols)
        else:  # an expert's w13 / w2 in FusedMoE
            yield from self._expert(hf, rows, cols, local, kind, part, expert, shapes)

    def _qkv(self, hf, dims, cols, local, part, shapes) -> Iterator[Region]:
        d, r, t = self.model.head_dim, self.rank, self.size
        fused = self.q_rows + 2 * self.kv_rows
        shapes[local] = (fused,) if dims == 1 else (fused, cols)
        if part == 0:
            yield Region(hf, r * self.q_rows, 0, self.q_rows, cols, local, 0, cols)
            return
        groups = self.model.num_query_groups
        first = r * groups // t if groups >= t else r // (t // groups)
        offset = (self.q_rows + (part - 1) * self.kv_rows) * cols
        yield Region(
            hf, first * d, 0, self.kv_rows, cols, local, offset, cols, replicated=groups < t
        )

    def _expert(self, hf, rows, cols, local, kind, part, expert, shapes) -> Iterator[Region]:
        experts, r, t = self.model.moe.num_experts, self.rank, self.size
        if kind == "w13":  # [I, H] per expert: a block of rows
            step = rows // t
            shapes[local] = (experts, 2 * step, cols)
            offset = (expert * 2 * step + part * step) * cols
            yield Region(hf, r * step, 0, step, cols, local, offset, cols)
        else:  # down_proj [H, I]: a block of columns
            step = cols // t
            shapes[local] = (experts, rows, step)
            yield Region(hf, 0, r * step, rows, step, local, expert * rows * step, step)
