"""The colocated stream: the actor's weights into the engine of each model replica, which
lives on the replica's first rank (its own process, or the client of a server, which then moves
them by ``rollout.weight_transport``: over a process group or through the host).

:func:`push_weights`: the live export's buckets (:mod:`~bapo_megatron.weights.export`) become
one stream of HF-named tensors that the engine loads with ``update_weights``. The export
gathers each pipeline stage's tensors on the stage's first tensor-parallel rank, and the engine
loads them bucket by bucket: its own stage's first, then each later stage's, sent over the
pipeline group as that stage exports them. No rank collects a whole stage (only the engine keeps
what it loads). A mixture-of-experts model's experts, divided over the expert-parallel ranks,
are broadcast over that group bucket by bucket, so that every replica's engine gets them all.
:class:`ColocatedStream` is this transport as the loop sees it (:class:`~.interface.WeightSync`).
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
from bapo_megatron.weights.export import WeightBucket, drain, export_weights, named_tensors_of


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
            drain(buckets)
    else:
        stream = _engine_stream(buckets, context)
        try:
            loaded = engine.update_weights(stream, version=version, checksum=checksum)
        except Exception as error:
            failure = error
        drain(stream)  # after a refusal, the other ranks still wait in the stream's exchanges
    # every rank raises, as trainer.replicas.stop_if_any_engine_failed does (weight_sync/ is
    # below trainer/ and does not import it)
    raise_if_any_rank_failed(
        failure,
        error_type=EngineFailure,
        where=f"stopped during the weight update to version {version}",
    )
    return loaded


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


class ColocatedStream:
    """:class:`~.interface.WeightSync` of colocated engines (``engine``: the replica's engine
    on the rank that holds it, else None) through :func:`push_weights`."""

    sent_bytes = 0
    """No transfer of its own leaves the replica's ranks (a server client moves the stream on
    by itself)."""

    def __init__(self, actor: Actor, engine: RolloutEngine | None, *, bucket_bytes: int) -> None:
        self.actor, self.engine, self.bucket_bytes = actor, engine, bucket_bytes

    def push(self, version: int) -> None:
        push_weights(self.actor, self.engine, version=version, bucket_bytes=self.bucket_bytes)

    def close(self) -> None:
        """Nothing to close: the engine is the replica's own."""
