"""What the training loop sees of the weight sync: one :class:`WeightSync`, opened once for the
actor's layout and this rank's engine (:func:`open_weight_sync`), pushed once per policy
version, closed with the run. Which transport it is follows from where the engines run and
``rollout.weight_transport`` (README.md beside this file draws each path):

- ``shard-to-shard``, any placement: :class:`~.shard_to_shard.ShardToShard`;
- engines on ranks of their own (disaggregated placement):
  :class:`~.stage_broadcast.EngineRanksBroadcast`;
- colocated engines, and servers driven from a thread of a trainer rank:
  :class:`~.colocated_stream.ColocatedStream` (a server client then moves the stream over a
  process group or through the host, by ``rollout.weight_transport``).
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

from bapo_megatron.actor.actor import Actor
from bapo_megatron.weight_sync.colocated_stream import ColocatedStream
from bapo_megatron.weight_sync.shard_to_shard import ShardToShard
from bapo_megatron.weight_sync.stage_broadcast import EngineRanksBroadcast
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast


class WeightSync(Protocol):
    """The actor's weights into every replica's engine, one policy version at a time."""

    sent_bytes: int
    """Weight bytes this rank has sent to other processes by transfers of its own so far (the
    engine links count the stage broadcasts they carry)."""

    def push(self, version: int) -> None:
        """The actor's current weights into the engines as policy ``version`` (collective over
        the trainer world). Any failure stops every trainer rank with
        :class:`~bapo_megatron.rollout.guard.EngineFailure`; an engine keeps serving its
        previous complete version, or refuses to generate until a whole update lands."""

    def close(self) -> None:
        """Release what the sync holds between pushes (a transfer group)."""


def open_weight_sync(
    actor: Actor,
    engine: Any | None,
    *,
    weight_transport: str,
    engine_ranks: bool,
    stage: StageBroadcast | None = None,
    bucket_bytes: int,
    timeout: datetime.timedelta,
) -> WeightSync:
    """The sync of this rank (no collective). ``engine``: the replica's engine, or the client
    of it, on the rank that holds it (None elsewhere); ``engine_ranks``: the engines run on ranks
    of their own, reached over the engine links, whose broadcast of this rank's pipeline stage is
    ``stage`` (replica 0's export ranks of later stages); ``weight_transport``:
    ``rollout.weight_transport``; ``bucket_bytes`` bounds what travels at once; ``timeout``
    bounds each wait of a shard-to-shard transfer."""
    if weight_transport == "shard-to-shard":
        return ShardToShard(actor, engine, bucket_bytes=bucket_bytes, timeout=timeout)
    if engine_ranks:
        return EngineRanksBroadcast(actor, engine, stage, bucket_bytes=bucket_bytes)
    return ColocatedStream(actor, engine, bucket_bytes=bucket_bytes)
