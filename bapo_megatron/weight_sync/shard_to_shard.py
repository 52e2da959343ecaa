"""The shard-to-shard weight sync (``rollout.weight_transport: shard-to-shard``): every engine
worker receives only its own shard, straight from the trainer ranks that hold it, with no tensor
gathered whole on any trainer rank.

Per update (collective over the trainer world), :func:`push_shards`:

1. each rank reads its shard map off its model chunks and the engine ranks read their engines'
   (:class:`~bapo_megatron.rollout.shard_receiver_protocol.ShardLayout`), each once per layout;
   when any of them changed since the last update (or there was none), one all-gather shares
   them and every rank computes the same plan
   (:func:`~bapo_megatron.resharding.plan.plan_reshard`), kept in
   :class:`~.shard_plan_cache.ShardSync`;
2. engines whose workers are processes of their own join a transfer group once
   (:mod:`.transfer_group`: the trainer's ranks first, then every replica's workers); an engine
   in a trainer rank's process (the embedded one) receives as that rank, in the world group;
3. the engine ranks start their engines' receive on a helper thread (workers get the plan over
   the group the first time), and every rank runs the plan
   (:func:`~bapo_megatron.resharding.execute.execute_plan`): the digest check, then one batched
   point-to-point call per bucket;
4. any failure, on any rank or worker, ends every trainer rank with
   :class:`~bapo_megatron.rollout.guard.EngineFailure`; an engine that received part of an
   update refuses to generate until a whole one lands.

:class:`ShardToShard` is this transport as the loop sees it (:class:`~.interface.WeightSync`).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import Actor
from bapo_megatron.distributed.collectives import describe_failure, raise_if_any_rank_failed
from bapo_megatron.models.name_maps import chunk_parameters
from bapo_megatron.resharding.execute import execute_plan, shared_plan
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.shard_receiver_protocol import ShardReceiver
from bapo_megatron.rollout.weight_group import in_background
from bapo_megatron.weight_sync.shard_plan_cache import ShardSync, plan_if_changed
from bapo_megatron.weight_sync.transfer_group import build_transfer_group, settled


def push_shards(
    actor: Actor,
    engine: ShardReceiver | None,
    sync: ShardSync,
    *,
    version: int,
    bucket_bytes: int,
    checksum: bool = False,
) -> list[Any] | None:
    """Send the actor's weights shard to shard into every replica's engine as policy
    ``version`` (collective over the trainer world; ``engine``: the replica's engine on the
    rank that holds it, else None). Returns, on engine ranks, the workers' reports (with
    ``checksum``, each worker's checksum of its weights)."""
    context = actor.context
    failure = reports = engine_side = None
    future = targets = None
    try:
        plan_if_changed(actor, engine, sync, bucket_bytes)
        if any(layout is not None and not layout.in_process for layout in sync.layouts):
            if sync.group is None:
                build_transfer_group(engine, sync, context)
            follows = sync.workers_hold != sync.plan.digest
            if engine is not None:
                request = {
                    "group_name": sync.group_name,
                    "digest": sync.plan.digest,
                    "plan_follows": follows,
                    "wire_dtype": sync.wire_dtype,
                    "timeout_s": sync.timeout.total_seconds(),
                    "checksum": checksum,
                }
                future = in_background(engine.receive_shards, request, version=version)
            if follows:
                shared_plan(sync.plan, sync.group, context.device)
                sync.workers_hold = sync.plan.digest
        in_process = engine is not None and sync.layouts[context.rank].in_process
        if in_process:
            targets = engine.shard_targets(sync.plan.targets_of(context.rank))
        sync.last = execute_plan(
            sync.plan,
            sync.group or dist.group.WORLD,
            timeout=sync.timeout,
            sources=_sources(actor),
            targets=targets,
            wire_dtype=getattr(torch, sync.wire_dtype),
        )
        sync.sent_bytes += sync.last.sent_bytes
        if in_process:
            reports = [engine.shards_received(version=version, checksum=checksum)]
        elif future is not None:
            reports = future.result(timeout=sync.timeout.total_seconds())
    except Exception as error:
        failure = error
        # Closing the group ends the peers' waits at once (a gloo peer that is gone is seen
        # only through its closed connection); the next update builds a new one. The engine's
        # call then ends too before the engine is called again.
        sync.close()
        sync.workers_hold = None
        if targets is not None:
            targets.abort()
        if future is not None:
            settled(future, sync.timeout)
            if future.done() and future.exception() not in (None, error):
                engine_side = future.exception()  # what the engine's side saw names it

    def described(error: BaseException) -> str:
        if engine_side is None:
            return describe_failure(error)
        return f"{describe_failure(error)}; the engine: {describe_failure(engine_side)}"

    raise_if_any_rank_failed(
        failure,
        error_type=EngineFailure,
        describe=described,
        where=f"stopped during the shard-to-shard weight update to version {version}",
    )
    return reports


def _sources(actor: Actor) -> dict[str, torch.Tensor]:
    return {
        name: param.detach() for chunk in actor.chunks for name, param in chunk_parameters(chunk)
    }


class ShardToShard:
    """:class:`~.interface.WeightSync` that sends shard to shard (``engine``: the replica's
    engine, or its client, on the rank that holds it, else None); the maps, plan and group are
    kept between pushes (:class:`~.shard_plan_cache.ShardSync`)."""

    def __init__(
        self,
        actor: Actor,
        engine: ShardReceiver | None,
        *,
        bucket_bytes: int,
        timeout: datetime.timedelta,
    ) -> None:
        self.actor, self.engine, self.bucket_bytes = actor, engine, bucket_bytes
        self.sync = ShardSync(timeout=timeout)

    @property
    def sent_bytes(self) -> int:
        """Bytes this rank has sent to other processes over every push so far."""
        return self.sync.sent_bytes

    def push(self, version: int) -> None:
        push_shards(
            self.actor, self.engine, self.sync, version=version, bucket_bytes=self.bucket_bytes
        )

    def close(self) -> None:
        """Leave the transfer group."""
        self.sync.close()
