"""The trainer's shard maps: which HF elements each Megatron rank holds, from the name maps and
each local parameter's tensor-parallel attributes, with no collective.

A rank's parameters are described by :class:`ParamPlacement`\\ s: read off its model chunks
(:func:`chunk_placements`, which works on the meta device) or computed from the layout alone
(:func:`layout_placements`, Megatron's placement rules: even pipeline stages with virtual
chunks, the embedding on the first stage and the output layer on the last, experts in contiguous
blocks per expert-parallel rank). :func:`trainer_shard_map` turns them into regions with the name
map's layouts: q/k/v interleaved per query group, gate/up stacked, row- and column-parallel
splits, an expert's matrices split over the expert tensor-parallel group, and embedding rows
past the vocabulary (Megatron's padding) marked as fills. The tied output layer of a pipeline's
last stage is a copy of the embedding and is no source.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from bapo_megatron.models.architecture import Architecture
from bapo_megatron.models.experts import local_experts
from bapo_megatron.models.name_maps import (
    ParamRule,
    chunk_parameters,
    hf_tensor_shapes,
    megatron_shape,
    name_map_for,
)
from bapo_megatron.models.shard_map import Fill, Region, ShardMap, matrix_shape

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
"""HF tensors whose rows are the vocabulary (padded by Megatron and by engines)."""


@dataclass(frozen=True)
class ParamPlacement:
    """One local Megatron parameter of a rank, as the shard map needs it."""

    name: str
    """Whole-model Megatron name (global layer and expert numbers); also the local tensor's name
    in the shard map."""
    shape: tuple[int, ...]
    """Local shape."""
    partition_dim: int | None
    """Megatron's ``partition_dim`` of a tensor-parallel parameter; None when replicated."""
    partition_stride: int = 1
    """Megatron's ``partition_stride``: how many pieces each rank's slice is made of (2 for
    stacked gate/up)."""


@dataclass(frozen=True)
class TrainerRank:
    """A trainer rank's coordinates in its layout."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    vpp_size: int = 1
    """Virtual pipeline chunks per stage."""


def chunk_placements(chunks: Iterable[torch.nn.Module]) -> list[ParamPlacement]:
    """The placements of a rank's model chunks (real or meta tensors), from Megatron's
    ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` attributes."""
    return [
        ParamPlacement(
            name,
            tuple(param.shape),
            param.partition_dim if getattr(param, "tensor_model_parallel", False) else None,
            getattr(param, "partition_stride", 1),
        )
        for chunk in chunks
        for name, param in chunk_parameters(chunk)
    ]


def stage_layers(num_layers: int, at: TrainerRank) -> list[int]:
    """Global layer numbers (from 0) of the stage ``at.pp_rank``, virtual chunk by chunk."""
    chunks = at.pp_size * at.vpp_size
    if num_layers % chunks:
        raise ValueError(
            f"{num_layers} layers cannot be split evenly over {at.pp_size} pipeline stages of "
            f"{at.vpp_size} virtual chunks"
        )
    per_chunk = num_layers // chunks
    return [
        v * (num_layers // at.vpp_size) + at.pp_rank * per_chunk + i
        for v in range(at.vpp_size)
        for i in range(per_chunk)
    ]


def layout_placements(
    model: Architecture, at: TrainerRank, padded_vocab: int | None = None
) -> list[ParamPlacement]:
    """The placements Megatron gives rank ``at`` (what :func:`chunk_placements` reads off its
    chunks), computed from the layout; ``padded_vocab``: the embedding's rows after Megatron's
    padding (default: the vocabulary)."""
    first, last = at.pp_rank == 0, at.pp_rank == at.pp_size - 1
    layers = set(stage_layers(model.num_layers, at))
    experts = (
        set(local_experts(model.moe.num_experts, at.ep_rank, at.ep_size))
        if model.moe is not None
        else set()
    )
    placements = []
    for rule in name_map_for(model.model_type).rules(model):
        if rule.megatron.startswith("decoder.layers."):
            if int(rule.megatron.split(".")[2]) not in layers:
                continue
            if rule.expert is not None and rule.expert not in experts:
                continue
        elif rule.megatron.startswith("embedding."):
            if not first:
                continue
        elif rule.megatron == "output_layer.weight" and model.tie_word_embeddings:
            if first:  # one stage: the embedding itself is the output layer
                continue
        elif not last:  # final norm, untied output layer
            continue
        size = at.etp_size if rule.expert is not None else at.tp_size
        shape = list(megatron_shape(rule, model, size))
        if rule.hf[0] in VOCAB_TENSORS:
            rows = padded_vocab or model.vocab_size
            if rows % size or rows < model.vocab_size:
                raise ValueError(
                    f"{rule.megatron}: {rows} vocabulary rows (vocabulary {model.vocab_size}) "
                    f"cannot be split over {size} tensor-parallel ranks"
                )
            shape[0] = rows // size
        placements.append(ParamPlacement(rule.megatron, tuple(shape), rule.tp_dim, _stride(rule)))
    return placements


def trainer_shard_map(
    model: Architecture,
    placements: Iterable[ParamPlacement],
    rank: int,
    at: TrainerRank,
    rules: Mapping[str, ParamRule] | None = None,
) -> ShardMap:
    """The shard map of trainer ``rank`` (coordinates ``at``) holding ``placements``
    (``rules``: the name map's rules by Megatron name, when the caller has them already).
    ``ValueError`` naming the parameter when a placement disagrees with the name map."""
    if rules is None:
        rules = {rule.megatron: rule for rule in name_map_for(model.model_type).rules(model)}
    regions: list[Region] = []
    fills: list[Fill] = []
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for placement in placements:
        rule = rules.get(placement.name)
        if rule is None:
            raise ValueError(
                f"trainer rank {rank}: {placement.name!r} has no rule in the "
                f"{model.model_type!r} name map"
            )
        if not rule.exported:
            continue
        split_rank, split_size = (
            (at.etp_rank, at.etp_size) if rule.expert is not None else (at.tp_rank, at.tp_size)
        )
        _check_placement(rule, placement, model, split_size, rank)
        shapes.append((placement.name, placement.shape))
        for part in _rule_parts(rule, placement, model, split_rank, split_size):
            (regions if isinstance(part, Region) else fills).append(part)
    return ShardMap(rank, tuple(regions), tuple(fills), tuple(shapes))


def _check_placement(
    rule: ParamRule, placement: ParamPlacement, model: Architecture, size: int, rank: int
) -> None:
    if placement.partition_dim != rule.tp_dim:
        raise ValueError(
            f"trainer rank {rank}: {placement.name} has partition_dim "
            f"{placement.partition_dim}, the name map splits it along {rule.tp_dim}"
        )
    if rule.tp_dim is not None and placement.partition_stride != _stride(rule):
        raise ValueError(
            f"trainer rank {rank}: {placement.name} has partition_stride "
            f"{placement.partition_stride}, the name map's {rule.layout!r} layout needs "
            f"{_stride(rule)}"
        )
    want = list(megatron_shape(rule, model, size))
    vocab = hf_tensor_shapes(rule, model)[0][0]
    if rule.hf[0] in VOCAB_TENSORS and placement.shape and placement.shape[0] * size >= vocab:
        want[0] = placement.shape[0]  # padded vocabulary rows
    if tuple(want) != placement.shape:
        raise ValueError(
            f"trainer rank {rank}: {placement.name} has local shape {placement.shape}, "
            f"expected {tuple(want)} at a split of {size}"
        )


def _stride(rule: ParamRule) -> int:
    """Megatron's ``partition_stride``: 2 for stacked gate/up (each rank holds its slice of
    gate, then of up), else 1."""
    return 2 if rule.layout == "gate_up" else 1


def _rule_parts(
    rule: ParamRule, placement: ParamPlacement, model: Architecture, rank: int, size: int
) -> Iterator[Region | Fill]:
    """The regions (and fills) of one local parameter."""
    local = placement.name
    hf_shapes = [matrix_shape(shape) for shape in hf_tensor_shapes(rule, model)]
    if rule.layout == "qkv":
        yield from _qkv_regions(rule, local, model, hf_shapes[0][1], rank, size)
        return
    if rule.layout == "gate_up":
        (rows, cols), step = hf_shapes[0], hf_shapes[0][0] // size
        for k, name in enumerate(rule.hf):
            yield Region(name, rank * step, 0, step, cols, local, k * step * cols, cols)
        return
    (name,), ((rows, cols),) = rule.hf, hf_shapes
    if rule.tp_dim is None:
        yield Region(name, 0, 0, rows, cols, local, 0, cols, replicated=size > 1)
    elif rule.tp_dim == 1:
        step = cols // size
        yield Region(name, 0, rank * step, rows, step, local, 0, step)
    else:
        local_rows = placement.shape[0]
        start = rank * local_rows
        held = max(0, min(rows, start + local_rows) - start)
        if held:
            yield Region(name, start, 0, held, cols, local, 0, cols)
        if held < local_rows:
            yield Fill(local, held * cols, local_rows - held, cols, cols)


def _qkv_regions(
    rule: ParamRule, local: str, model: Architecture, cols: int, rank: int, size: int
) -> Iterator[Region]:
    """Megatron's fused q/k/v: per query group, its query heads, then its key and value head."""
    d = model.head_dim
    per_group = model.num_attention_heads // model.num_query_groups
    groups = model.num_query_groups // size
    q, k, v = rule.hf
    for j in range(groups):
        g = rank * groups + j
        base = j * (per_group + 2) * d * cols
        yield Region(q, g * per_group * d, 0, per_group * d, cols, local, base, cols)
        yield Region(k, g * d, 0, d, cols, local, base + per_group * d * cols, cols)
        yield Region(v, g * d, 0, d, cols, local, base + (per_group + 1) * d * cols, cols)
