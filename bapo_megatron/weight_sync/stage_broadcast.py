"""The stage broadcast: weights to engines on ranks of their own (disaggregated placement), each
pipeline stage's tensors broadcast from its export rank to every engine replica over the wire of
:mod:`.stage_broadcast_wire`.

:func:`push_weights_to_engines`: data-parallel replica 0 exports; its first rank broadcasts stage
0 through its engine client (the client's ``update_weights``), the export ranks of its later
stages broadcast their own. A mixture-of-experts model's experts are gathered onto those export
ranks over the expert-parallel group, whose other members (expert data-parallel rank 0) may
belong to other replicas. :class:`EngineRanksBroadcast` is this transport as the loop sees it
(:class:`~.interface.WeightSync`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from bapo_megatron.actor.actor import Actor
from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.protocol import RolloutEngine
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast
from bapo_megatron.weights.export import drain, export_weights, named_tensors_of


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
    drain(stream)  # the export's tensor-parallel exchanges go on to the end on every TP rank
    raise_if_any_rank_failed(
        failure,
        error_type=EngineFailure,
        where=f"stopped during the weight update to version {version}",
    )
    return loaded


def _drained(items: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """A stream that yields nothing and, when iterated, runs ``items`` to its end."""
    drain(items)
    yield from ()


class EngineRanksBroadcast:
    """:class:`~.interface.WeightSync` of engines on ranks of their own through
    :func:`push_weights_to_engines` (``engine``: the replica's engine client on its first rank;
    ``stage``: this rank's stage broadcast on replica 0's export ranks of later stages)."""

    sent_bytes = 0
    """The broadcasts are the engine links' (``EngineLink.sent_bytes`` counts them)."""

    def __init__(
        self,
        actor: Actor,
        engine: RolloutEngine | None,
        stage: StageBroadcast | None,
        *,
        bucket_bytes: int,
    ) -> None:
        self.actor, self.engine, self.stage = actor, engine, stage
        self.bucket_bytes = bucket_bytes

    def push(self, version: int) -> None:
        push_weights_to_engines(
            self.actor, self.engine, self.stage, version=version, bucket_bytes=self.bucket_bytes
        )

    def close(self) -> None:
        """Nothing to close: the links are closed with the run's engines."""
