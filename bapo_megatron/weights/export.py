"""Live export of the actor's sharded parameters as HF-named full tensors, in bounded buckets.

Each pipeline stage exports its own layers; within a stage, the tensor-parallel shards of a
bucket are gathered with one collective over the TP group into its first rank (or every rank),
which reassembles whole HF tensors with the family's name map. No rank holds more than its own
shard of the model plus about two buckets. Two layers:

- :func:`plan_buckets` (pure, metadata in, buckets out): which parameters go together, in HF
  order, so that each bucket's HF tensors total at most ``bucket_bytes`` in the export dtype.
  A single parameter larger than the bound travels alone in a bucket of its own.
- :func:`export_weights` (the executor): a generator that every rank of a TP group iterates in
  step (it runs collectives); it yields :class:`WeightBucket`\\ s, each stamped with the policy
  version, on the receiving ranks. Transports (an engine's ``update_weights``, a file writer)
  consume the buckets; they are not this module's concern.

Call it on the ranks of one data-parallel replica (the others hold the same weights); with
virtual pipelining a stage exports all of its chunks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.config import ModelConfig
from bapo_megatron.parallel import ParallelContext
from bapo_megatron.weights.name_maps import (
    ParamRule,
    chunk_parameters,
    hf_tensor_shapes,
    name_map_for,
    split,
)

DEFAULT_BUCKET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class WeightBucket:
    """Whole HF tensors of one pipeline stage, ready for a rollout engine."""

    version: int
    """Policy version (optimizer steps) the weights belong to."""
    pipeline_rank: int
    """Stage that exported them."""
    index: int
    """Position of this bucket among the stage's buckets of this export (0, 1, ...)."""
    last: bool
    """Whether it is the stage's last bucket of this export."""
    tensors: dict[str, torch.Tensor]
    """HF name -> whole tensor, in HF order."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def rule_nbytes(rule: ParamRule, model: ModelConfig, element_size: int) -> int:
    """Bytes of the whole HF tensors of ``rule`` at ``element_size`` bytes per element."""
    return sum(math.prod(shape) for shape in hf_tensor_shapes(rule, model)) * element_size


def plan_buckets(rules: Sequence[ParamRule], model: ModelConfig, bucket_bytes: int,
                 element_size: int) -> list[list[ParamRule]]:
    """Group ``rules`` (in their order) greedily into buckets of at most ``bucket_bytes`` of HF
    tensors; a rule larger than the bound forms a bucket alone. Rules not exported (the tied
    output layer) are dropped."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[ParamRule]] = []
    filled = bucket_bytes  # forces a new bucket for the first rule
    for rule in rules:
        if not rule.exported:
            continue
        size = rule_nbytes(rule, model, element_size)
        if filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(rule)
        filled += size
    return buckets


def _gather(flat: torch.Tensor, context: ParallelContext, to_all: bool) -> list[torch.Tensor] | None:
    """Every TP rank's ``flat`` (one collective), on the first TP rank or on all of them."""
    if context.tp_size == 1:
        return [flat]
    if to_all:
        out = torch.empty(context.tp_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(out, flat, group=context.tp_group)
        return list(out.chunk(context.tp_size))
    first = dist.get_global_rank(context.tp_group, 0)
    if context.tp_rank == 0:
        pieces = [torch.empty_like(flat) for _ in range(context.tp_size)]
        dist.gather(flat, pieces, dst=first, group=context.tp_group)
        return pieces
    dist.gather(flat, None, dst=first, group=context.tp_group)
    return None


def _export_bucket(rules: list[ParamRule], params: dict[str, torch.Tensor], model: ModelConfig,
                   context: ParallelContext, dtype: torch.dtype, to_all: bool
                   ) -> dict[str, torch.Tensor] | None:
    """The whole HF tensors of one bucket on the receiving ranks, None on the others."""
    split_rules = [r for r in rules if r.tp_dim is not None and context.tp_size > 1]
    receives = to_all or context.tp_rank == 0
    pieces = None
    if split_rules:
        # this rank's shards, flattened into one buffer in the export dtype (the conversion
        # happens before the transfer)
        flat = torch.empty(sum(params[r.megatron].numel() for r in split_rules), dtype=dtype,
                           device=params[split_rules[0].megatron].device)
        offset = 0
        for rule in split_rules:
            shard = params[rule.megatron]
            flat[offset:offset + shard.numel()].view(shard.shape).copy_(shard)
            offset += shard.numel()
        pieces = _gather(flat, context, to_all)
    if not receives:
        return None
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for rule in rules:
        shard = params[rule.megatron]
        whole = [torch.empty(shape, dtype=dtype, device=shard.device)
                 for shape in hf_tensor_shapes(rule, model)]
        if rule in split_rules:
            for rank, piece in enumerate(pieces):
                local = piece[offset:offset + shard.numel()].view(shard.shape)
                for target, part in zip(whole, split(rule, local, model)):
                    step = part.shape[rule.tp_dim]
                    target.narrow(rule.tp_dim, rank * step, step).copy_(part)
            offset += shard.numel()
        else:
            for target, part in zip(whole, split(rule, shard, model)):
                target.copy_(part)
        out.update(zip(rule.hf, whole))
    return out


@torch.no_grad()
def export_weights(chunks: Sequence[torch.nn.Module], model: ModelConfig,
                   context: ParallelContext, *, version: int,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                   to_all_tp_ranks: bool = False) -> Iterator[WeightBucket]:
    """Yield this stage's parameters as whole HF tensors in buckets of at most ``bucket_bytes``
    (a single larger tensor group, e.g. a big embedding, comes alone).

    Every rank of the TP group must iterate the generator to the end (each bucket is one
    collective). The buckets are yielded on the first TP rank of the stage, or on every TP rank
    with ``to_all_tp_ranks``; other ranks yield nothing. ``dtype`` (default: the parameters')
    is the dtype of the yielded tensors. ``version`` is stamped on every bucket.
    """
    name_map = name_map_for(model.model_type)
    rules = name_map.rules(model)
    params: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        params.update((name, p.detach()) for name, p in chunk_parameters(chunk))
    unknown = sorted(set(params) - {r.megatron for r in rules})
    if unknown:
        raise ValueError(f"export: parameters {unknown} have no rule in the "
                         f"{model.model_type!r} name map")
    if not params:
        return
    dtype = dtype or next(iter(params.values())).dtype
    owned = [r for r in rules if r.megatron in params]
    element_size = torch.empty((), dtype=dtype).element_size()
    buckets = plan_buckets(owned, model, bucket_bytes, element_size)
    for index, bucket in enumerate(buckets):
        tensors = _export_bucket(bucket, params, model, context, dtype, to_all_tp_ranks)
        if tensors is not None:
            yield WeightBucket(version=version, pipeline_rank=context.pp_rank, index=index,
                               last=index == len(buckets) - 1, tensors=tensors)
