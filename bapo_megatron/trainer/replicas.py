"""Colocated execution: the rollout engine lives on the first rank of each model replica (tensor,
pipeline and context rank 0), next to that rank's part of the actor.

- :func:`push_weights`: the live export gathers each pipeline stage's tensors on the stage's
  first tensor-parallel rank; the engine loads them as one stream of HF-named tensors, bucket by
  bucket: its own stage's first, then each later stage's, sent over the pipeline group as that
  stage exports them. No rank collects a whole stage (only the engine keeps what it loads).
- :func:`share_from_engine_rank`: what the engine rank produced (scored groups, rollout
  statistics) is broadcast to the replica's other ranks, which all need the batch.
- :func:`stop_if_any_engine_failed` (and :func:`engine_failures_stop_every_rank`,
  :func:`call_engine` around engine-rank work): an engine rank that failed tells every rank of
  the run, so they all stop with its error instead of waiting in a collective for a rank that is
  gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import Actor
from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.protocol import RolloutEngine
from bapo_megatron.weights.export import WeightBucket, export_weights


def holds_engine(context: ParallelContext) -> bool:
    """Whether this rank runs its replica's rollout engine."""
    return context.tp_rank == 0 and context.pp_rank == 0 and context.cp_rank == 0


def push_weights(actor: Actor, engine: RolloutEngine | None, *, version: int, bucket_bytes: int,
                 checksum: bool = False) -> str | None:
    """Export the actor's weights into its replica's engine as policy ``version`` (collective
    over the world; ``engine`` is None except on :func:`holds_engine` ranks). Returns the
    engine's checksum of what it loaded (engine rank, with ``checksum``), else None.

    If the engine refuses the update, the engine rank still drains the stream (every other rank
    is in the middle of it), then every rank raises :class:`EngineFailure`."""
    context = actor.context
    buckets = export_weights(actor.chunks, actor.model_config, context, version=version,
                             bucket_bytes=bucket_bytes)
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
        except Exception as error:  # noqa: BLE001 - every rank stops with it
            failure = error
        _drain(stream)  # after a refusal, the other ranks still wait in the stream's exchanges
    stop_if_any_engine_failed(failure, context, during=f"the weight update to version {version}")
    return loaded


def stop_if_any_engine_failed(failure: BaseException | None, context: ParallelContext, *,
                              during: str) -> None:
    """Collective over the world: raise :class:`EngineFailure` on every rank if any rank passes
    a ``failure`` (its engine's error; None elsewhere)."""
    raise_if_any_rank_failed(failure, where=f"stopped during {during}", error_type=EngineFailure)


@contextlib.contextmanager
def engine_failures_stop_every_rank(context: ParallelContext, *, during: str) -> Iterator[None]:
    """Collective over the world at the end of the block: an ``Exception`` raised in the block
    (on an engine rank, or any other) is caught, and then every rank raises
    :class:`EngineFailure` naming it, instead of the others waiting for the failed rank."""
    failure = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 - every rank stops with it, none waits for this one
        failure = error
    stop_if_any_engine_failed(failure, context, during=during)


def call_engine(engine: RolloutEngine | None, method: str, context: ParallelContext, *,
                during: str) -> None:
    """Collective over the world: ``engine.<method>()`` on the engine ranks (``engine`` is None
    elsewhere); if it raises on any rank, every rank raises :class:`EngineFailure` naming the
    call and the error."""
    with engine_failures_stop_every_rank(context, during=f"engine.{method}() {during}"):
        if engine is not None:
            getattr(engine, method)()


def _drain(items: Iterable) -> None:
    for _ in items:
        pass


def _engine_stream(own: Iterable[WeightBucket], context: ParallelContext
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine rank's stream: its stage's tensors, then those of stages 1, 2, ... in order."""
    for bucket in own:
        yield from bucket.tensors.items()
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


def share_from_engine_rank(payload: Any, context: ParallelContext) -> Any:
    """``payload`` of the replica's engine rank, on every rank of the replica (a broadcast over
    the model-parallel group; other ranks pass None)."""
    group = context.process_groups.mp
    if dist.get_world_size(group) == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
