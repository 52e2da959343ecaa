"""The actor's weights into a rollout engine: the live export's buckets
(:mod:`~bapo_megatron.weights.export`) become one stream of HF-named tensors that the engine
loads with ``update_weights``.

- :func:`named_tensors_of`: the one flattening of export buckets into (name, tensor) pairs.
- :func:`push_weights`: the trainer's weight sync. The engine lives on the first rank of each
  model replica; the export gathers each pipeline stage's tensors on the stage's first
  tensor-parallel rank, and the engine loads them bucket by bucket: its own stage's first, then
  each later stage's, sent over the pipeline group as that stage exports them. No rank collects
  a whole stage (only the engine keeps what it loads). A mixture-of-experts model's experts,
  divided over the expert-parallel ranks, are broadcast over that group bucket by bucket, so
  that every replica's engine gets them all.
- :func:`push_weights_to_engines`: the same for engines on ranks of their own (disaggregated
  placement): data-parallel replica 0 exports, and each of its stages broadcasts its own tensors
  to every engine replica (:mod:`~bapo_megatron.weights.broadcast`). A mixture-of-experts
  model's experts are gathered onto those export ranks over the expert-parallel group, whose
  other members (expert data-parallel rank 0) may belong to other replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import Actor
from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.protocol import RolloutEngine
from bapo_megatron.weights.broadcast import StageBroadcast
from bapo_megatron.weights.export import WeightBucket, export_weights


def named_tensors_of(buckets: Iterable[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of export buckets (:class:`WeightBucket`, or anything with a
    ``tensors`` dict), in order: what an engine's ``update_weights`` takes."""
    for bucket in buckets:
        yield from bucket.tensors.items()


def push_weights(
    actor: Actor,
    engine: RolloutEngine | None,
    *,
    version: int,
    bucket_bytes: int,
    checksum: bool = False,
) -> str | None:
    """Export the actor's weights into its replica's engine as policy ``version`` (collective
    over the world; ``engine`` is None except on the replica's engine rank: tensor, pipeline
    and context rank 0). Returns the engine's checksum of what it loaded (engine rank, with
    ``checksum``), else None.

    If the engine refuses the update, the engine rank still drains the stream (every other rank
    is in the middle of it), then every rank raises :class:`EngineFailure`."""
    context = actor.context
    # with experts divided over the expert-parallel ranks (across replicas), every replica's
    # engine needs them all: each exporting rank gathers its stage's over the EP group
    buckets = export_weights(
        actor.chunks,
        actor.model_config,
        context,
        version=version,
        bucket_bytes=bucket_bytes,
        all_experts=True,
    )
    # Ranks other than TP rank 0 only take part in the export's TP exchanges; with context
    # parallelism, CP rank 0's stages are the ones that send.
    sends = context.pp_size > 1 and context.tp_rank == 0 and context.cp_rank == 0
    loaded = failure = None
    if engine is None:
        if sends and context.pp_rank > 0:
            _send_stage(buckets, context)
        else:
            _drain(buckets)
    else:
        stream = _engine_stream(buckets, context)
        try:
            loaded = engine.update_weights(stream, version=version, checksum=checksum)
        except Exception as error:
            failure = error
        _drain(stream)  # after a refusal, the other ranks still wait in the stream's exchanges
    # every rank raises, as trainer.replicas.stop_if_any_engine_failed does (weights/ is below
    # trainer/ and does not import it)
    raise_if_any_rank_failed(
        failure,
        error_type=EngineFailure,
        where=f"stopped during the weight update to version {version}",
    )
    return loaded


def push_weights_to_engines(
    actor: Actor,
    engine: RolloutEngine | None,
    stage: StageBroadcast | None,
    *,
    version: int,
    bucket_bytes: int,
    checksum: bool = False,
) -> str | None:
    """Disaggregated weight sync (collective over the trainer world): every replica's first rank
    asks its engine (``engine``, the remote client) for an update to ``version``; replica 0's
    ranks export, its first rank broadcasts stage 0 through its client and its other stages'
    export ranks broadcast their own (``stage``). Returns the engine's checksum (with
    ``checksum``, on the client ranks). Any failure stops every trainer rank with
    :class:`EngineFailure`, after the export's exchanges are drained."""
    context = actor.context
    loaded = failure = None
    stream: Iterator[tuple[str, torch.Tensor]] = iter(())
    # The other replicas hold the same weights: replica 0 exports its dense tensors. Experts are
    # divided over the expert-parallel group, which Megatron carves out of data (and tensor)
    # parallel ranks: the group of expert data-parallel rank 0 (replica 0's ranks among them)
    # gathers every expert onto replica 0's export ranks.
    dense = context.dp_rank == 0
    experts = context.edp_rank == 0
    if dense or experts:
        stream = named_tensors_of(
            export_weights(
                actor.chunks,
                actor.model_config,
                context,
                version=version,
                bucket_bytes=bucket_bytes,
                dense=dense,
                experts=experts,
                all_experts=True,
            )
        )
        if not dense:
            # This rank only helps replica 0's export. Its engine client (another replica's
            # first rank) sends the update request first and then runs the stream to its end,
            # so the engines are receiving while this rank's experts travel.
            stream = _drained(stream)
    try:
        if engine is not None:
            loaded = engine.update_weights(stream, version=version, checksum=checksum)
        elif stage is not None:
            stage.send(stream, version=version, bucket_bytes=bucket_bytes)
    except Exception as error:
        failure = error
    _drain(stream)  # the export's tensor-parallel exchanges go on to the end on every TP rank
    raise_if_any_rank_failed(
        failure,
        error_type=EngineFailure,
        where=f"stopped during the weight update to version {version}",
    )
    return loaded


def _drain(items: Iterable) -> None:
    for _ in items:
        pass


def _drained(items: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream that yields nothing and, when iterated, runs ``items`` to its end."""
    _drain(items)
    yield from ()


def _engine_stream(
    own: Iterable[WeightBucket], context: ParallelContext
) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine rank's stream: its stage's tensors, then those of stages 1, 2, ... in order."""
    yield from named_tensors_of(own)
    for stage in range(1, context.pp_size):
        yield from _received_stage(stage, context)


# Over the pipeline group, a stage sends, per bucket, its tensors' (name, shape, dtype) as one
# object, then the tensors; an empty list ends the stage.


def _send_stage(buckets: Iterable[WeightBucket], context: ParallelContext) -> None:
    engine_rank = dist.get_global_rank(context.pp_group, 0)
    for bucket in buckets:
        header = [[(name, tuple(t.shape), t.dtype) for name, t in bucket.tensors.items()]]
        dist.send_object_list(header, dst=engine_rank, group=context.pp_group)
        for tensor in bucket.tensors.values():
            dist.send(tensor.contiguous(), dst=engine_rank, group=context.pp_group)
    dist.send_object_list([[]], dst=engine_rank, group=context.pp_group)


def _received_stage(stage: int, context: ParallelContext) -> Iterator[tuple[str, torch.Tensor]]:
    source = dist.get_global_rank(context.pp_group, stage)
    while True:
        header: list[Any] = [None]
        dist.recv_object_list(header, src=source, group=context.pp_group)
        if not header[0]:
            return
        for name, shape, dtype in header[0]:
            tensor = torch.empty(shape, dtype=dtype, device=context.device)
            dist.recv(tensor, src=source, group=context.pp_group)
            yield name, tensor
