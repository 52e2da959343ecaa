"""Live export of the actor's sharded parameters as HF-named full tensors, in bounded buckets.

Each pipeline stage exports its own layers; within a stage, the tensor-parallel shards of a
bucket are put together into whole HF tensors on its first TP rank (or every TP rank) with the
family's name map, by one exchange over the TP group. No rank holds more than its own shard of
the model plus about two buckets. Two layers:

- :func:`plan_buckets` (pure, metadata in, buckets out): which parameters go together, in HF
  order, so that each bucket's HF tensors total at most ``bucket_bytes`` in the export dtype.
  A single parameter larger than the bound travels alone in a bucket of its own.
- :func:`export_weights` (the executor): a generator that every rank of a TP group iterates in
  step; it yields :class:`WeightBucket`\\ s, each stamped with the policy version, on the
  receiving ranks. How shards move inside the TP group is a transport
  (:mod:`~bapo_megatron.weights.tp_assembly`: shared memory on one CPU host, else a
  torch.distributed gather); what consumes the buckets (an engine's weight update, a file
  writer) is not this module's concern: :func:`named_tensors_of` flattens them into the
  (name, tensor) pairs an engine's ``update_weights`` takes.

Call it on the ranks of one data-parallel replica (the others hold the same weights); with
virtual pipelining a stage exports all of its chunks. A mixture-of-experts model's experts are
divided over the expert-parallel ranks, which Megatron carves out of data (and tensor) parallel:
each rank exports the experts it holds, on the ranks of expert data-parallel rank 0
(``experts``), after the stage's dense tensors: without any exchange, or with expert tensor
parallelism gathered over the expert-TP group onto its first rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.config import ModelConfig
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.models.name_maps import (
    ParamRule,
    chunk_parameters,
    hf_tensor_shapes,
    name_map_for,
    place_shard,
    split,
)
from bapo_megatron.weights.tp_assembly import ShardTransport, TransportKind, make_transport

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
    expert_rank: int | None = None
    """The expert-parallel rank whose experts these are; None for a bucket of dense tensors
    (``index`` counts each kind apart)."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def named_tensors_of(buckets: Iterable[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of export buckets (:class:`WeightBucket`, or anything with a
    ``tensors`` dict), in order: what an engine's ``update_weights`` takes."""
    for bucket in buckets:
        yield from bucket.tensors.items()


def drain(stream: Iterable) -> None:
    """Run an export (or a stream made of one) to its end: every rank of a TP group takes part
    in every bucket's exchange, whether or not it keeps what it yields."""
    for _ in stream:
        pass


def rule_nbytes(rule: ParamRule, model: ModelConfig, element_size: int) -> int:
    """Bytes of the whole HF tensors of ``rule`` at ``element_size`` bytes per element."""
    return sum(math.prod(shape) for shape in hf_tensor_shapes(rule, model)) * element_size


def plan_buckets(
    rules: Sequence[ParamRule], model: ModelConfig, bucket_bytes: int, element_size: int
) -> list[list[ParamRule]]:
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


@torch.no_grad()
def export_weights(
    chunks: Sequence[torch.nn.Module],
    model: ModelConfig,
    context: ParallelContext,
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    to_all_tp_ranks: bool = False,
    transport: TransportKind | ShardTransport = "auto",
    dense: bool = True,
    experts: bool = True,
    all_experts: bool = False,
) -> Iterator[WeightBucket]:
    """Yield this stage's parameters as whole HF tensors in buckets of at most ``bucket_bytes``
    (a single larger tensor group, e.g. a big embedding, comes alone).

    Every rank of the TP group must iterate the generator to the end (each bucket is one
    exchange over the TP group). The buckets are yielded on the first TP rank of the stage, or on
    every TP rank with ``to_all_tp_ranks``; other ranks yield nothing. ``dtype`` (default:
    ``model.params_dtype``) is the dtype of the yielded tensors. ``version`` is stamped on every
    bucket. ``dense`` / ``experts`` choose what this rank exports (``dense`` must agree over the
    TP group); an MoE model's expert buckets come after the dense ones, from this rank alone,
    or with ``all_experts`` every expert of the stage on every rank of the expert-parallel group
    of expert-TP rank 0 (each rank's buckets broadcast over it in turn; collective over the
    group): what an engine that runs the whole model needs.
    ``transport`` moves the shards (:mod:`~bapo_megatron.weights.tp_assembly`): `auto` takes
    shared memory for CPU ranks on one host, else the torch.distributed collective; or a
    transport built once with :func:`~bapo_megatron.weights.tp_assembly.make_transport` and
    passed to every export, e.g. with ``reuse=True`` (then each bucket's tensors are valid only
    until the next bucket is requested).
    """
    name_map = name_map_for(model.model_type)
    rules = name_map.rules(model)
    params: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        params.update((name, p.detach()) for name, p in chunk_parameters(chunk))
    unknown = sorted(set(params) - {r.megatron for r in rules})
    if unknown:
        raise ValueError(
            f"export: parameters {unknown} have no rule in the {model.model_type!r} name map"
        )
    if not params:
        return
    dtype = dtype or getattr(torch, model.params_dtype)  # the same on every stage
    owned = [r for r in rules if r.megatron in params]
    element_size = torch.empty((), dtype=dtype).element_size()
    expert_rules = [r for r in owned if r.expert is not None] if experts else []
    expert_buckets = plan_buckets(expert_rules, model, bucket_bytes, element_size)
    buckets = (
        plan_buckets([r for r in owned if r.expert is None], model, bucket_bytes, element_size)
        if dense
        else []
    )
    yield from _export_dense(
        buckets,
        params,
        model,
        context,
        version,
        dtype,
        to_all_tp_ranks,
        transport,
        more_after=bool(expert_buckets) and context.etp_rank == 0,
    )
    own = (
        WeightBucket(
            version=version,
            pipeline_rank=context.pp_rank,
            index=index,
            last=index == len(expert_buckets) - 1,
            tensors=tensors,
            expert_rank=context.ep_rank,
        )
        for index, bucket in enumerate(expert_buckets)
        if (tensors := _whole_experts(bucket, params, model, context, dtype)) is not None
    )
    if all_experts and experts and context.ep_size > 1:
        # with expert tensor parallelism only expert-TP rank 0 holds whole tensors; the
        # expert-parallel groups of the other expert-TP ranks exchange nothing
        yield from _every_rank_experts(own, context, version)
    else:
        yield from own


def _every_rank_experts(
    own: Iterator[WeightBucket], context: ParallelContext, version: int
) -> Iterator[WeightBucket]:
    """This rank's expert buckets, and those of the other ranks of the expert-parallel group:
    rank by rank, the source broadcasts each bucket's (name, shape, dtype) list, then the
    tensors; an empty list ends its turn."""
    group = context.ep_group
    for source in range(context.ep_size):
        root = dist.get_global_rank(group, source)
        mine = source == context.ep_rank
        index = 0
        while True:
            bucket = next(own, None) if mine else None
            header: list = [
                None
                if not mine
                else []
                if bucket is None
                else [(n, tuple(t.shape), t.dtype) for n, t in bucket.tensors.items()]
            ]
            dist.broadcast_object_list(header, src=root, group=group)
            if not header[0]:
                break
            tensors = {}
            for name, shape, dtype in header[0]:
                tensor = (
                    bucket.tensors[name].contiguous()
                    if mine
                    else torch.empty(shape, dtype=dtype, device=context.device)
                )
                dist.broadcast(tensor, src=root, group=group)
                tensors[name] = tensor
            yield WeightBucket(
                version=version,
                pipeline_rank=context.pp_rank,
                index=index,
                last=False,
                tensors=tensors,
                expert_rank=source,
            )
            index += 1


def _whole_experts(
    rules: list[ParamRule],
    params: dict[str, torch.Tensor],
    model: ModelConfig,
    context: ParallelContext,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor] | None:
    """The whole HF tensors of these expert ``rules``: this rank's own, or with expert tensor
    parallelism the shards of the expert-TP group gathered (collective over it) onto its first
    rank (None on the others)."""
    tensors: dict[str, torch.Tensor] = {}
    for rule in rules:
        shard = params[rule.megatron].to(dtype).contiguous()
        if context.etp_size == 1:
            tensors.update(zip(rule.hf, (t.clone() for t in split(rule, shard, model))))
            continue
        pieces = [torch.empty_like(shard) for _ in range(context.etp_size)]
        dist.all_gather(pieces, shard, group=context.etp_group)
        if context.etp_rank != 0:
            continue
        wholes = [
            torch.empty(shape, dtype=dtype, device=shard.device)
            for shape in hf_tensor_shapes(rule, model)
        ]
        for rank, piece in enumerate(pieces):
            place_shard(rule, wholes, piece, rank, model)
        tensors.update(zip(rule.hf, wholes))
    return tensors if context.etp_rank == 0 else None


def _export_dense(
    buckets: list[list[ParamRule]],
    params: dict[str, torch.Tensor],
    model: ModelConfig,
    context: ParallelContext,
    version: int,
    dtype: torch.dtype,
    to_all_tp_ranks: bool,
    transport: TransportKind | ShardTransport,
    *,
    more_after: bool,
) -> Iterator[WeightBucket]:
    """The dense buckets of :func:`export_weights`, through the TP group's transport."""
    if not buckets:
        return
    if isinstance(transport, str):
        mover = make_transport(
            transport, context, next(iter(params.values())).device, to_all_tp_ranks
        )
    elif transport.to_all != to_all_tp_ranks:
        raise ValueError(
            f"export: the transport was built with to_all={transport.to_all}, "
            f"but to_all_tp_ranks={to_all_tp_ranks}"
        )
    else:
        mover = transport
    for index, bucket in enumerate(buckets):
        tensors = mover.assemble(bucket, params, model, dtype)
        if tensors is not None:
            yield WeightBucket(
                version=version,
                pipeline_rank=context.pp_rank,
                index=index,
                last=index == len(buckets) - 1 and not more_after,
                tensors=tensors,
            )
