"""The shard-to-shard weight sync (``rollout.weight_transport: shard-to-shard``): every engine
worker receives only its own shard, straight from the trainer ranks that hold it, with no tensor
gathered whole on any trainer rank.

Per update (collective over the trainer world), :func:`push_shards`:

1. each rank reads its shard map off its model chunks and the engine ranks read their engines'
   (:class:`~bapo_megatron.rollout.shard_receiver.ShardLayout`, read once per engine); when
   any of them changed since the last update (or there was none), one all-gather shares them
   and every rank computes the same plan (:func:`~bapo_megatron.resharding.plan.plan_reshard`),
   kept in :class:`ShardSync`;
2. engines whose workers are processes of their own join a transfer group once (the trainer's
   ranks first, then every replica's workers); an engine in a trainer rank's process (the
   embedded one) receives as that rank, in the world group;
3. the engine ranks start their engines' receive on a helper thread (workers get the plan over
   the group the first time), and every rank runs the plan
   (:func:`~bapo_megatron.resharding.execute.execute_plan`): the digest check, then one batched
   point-to-point call per bucket;
4. any failure, on any rank or worker, ends every trainer rank with
   :class:`~bapo_megatron.rollout.guard.EngineFailure`; an engine that received part of an
   update refuses to generate until a whole one lands.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import socket
import uuid
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import Actor
from bapo_megatron.distributed.collectives import describe_failure, raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.models.name_maps import chunk_parameters, name_map_for
from bapo_megatron.models.shard_map import ShardMap
from bapo_megatron.models.trainer_shards import TrainerRank, chunk_placements, trainer_shard_map
from bapo_megatron.resharding.execute import TransferCounts, execute_plan, shared_plan
from bapo_megatron.resharding.plan import ReshardPlan, plan_reshard
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.shard_receiver import ShardLayout, ShardReceiver
from bapo_megatron.rollout.weight_group import (
    in_background,
    join_weight_group,
    leave_weight_group,
)


@dataclass
class ShardSync:
    """What the shard-to-shard sync keeps between updates on one trainer rank."""

    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    """Bounds joining the group and each wait of a transfer (a training run passes
    ``parallel.collective_timeout_s``)."""
    plan: ReshardPlan | None = None
    key: str = ""
    """This rank's map, its engine's layout and the bucket size the plan was made for."""
    layouts: list[ShardLayout | None] = field(default_factory=list)
    """Per trainer rank, the layout of the engine it holds (None: no engine)."""
    group: dist.ProcessGroup | None = None
    """The transfer group (trainer ranks, then engine workers); None: the world group."""
    group_name: str = ""
    workers_hold: str | None = None
    """Digest of the plan the engine workers hold."""
    last: TransferCounts | None = None
    """What this rank moved in the last update."""
    sent_bytes: int = 0
    """Bytes this rank has sent to other processes over every update so far."""
    _store: Any = None

    def close(self) -> None:
        if self.group is not None:
            leave_weight_group(self.group)
        self.group = self._store = None


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
        _plan_if_changed(actor, engine, sync, bucket_bytes)
        if any(layout is not None and not layout.in_process for layout in sync.layouts):
            if sync.group is None:
                _build_group(engine, sync, context)
            follows = sync.workers_hold != sync.plan.digest
            if engine is not None:
                request = {
                    "group_name": sync.group_name,
                    "digest": sync.plan.digest,
                    "plan_follows": follows,
                    "wire_dtype": _wire_dtype(sync),
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
            wire_dtype=getattr(torch, _wire_dtype(sync)),
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
            _settled(future, sync.timeout)
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


def _settled(future: Future, timeout: datetime.timedelta) -> None:
    """Wait for ``future`` to end, whatever its outcome, at most ``timeout``."""
    wait_futures([future], timeout=timeout.total_seconds())


def trainer_map(actor: Actor) -> ShardMap:
    """This rank's shard map, read off its model chunks (no collective)."""
    ctx = actor.context
    at = TrainerRank(
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
        pp_rank=ctx.pp_rank,
        pp_size=ctx.pp_size,
        ep_rank=ctx.ep_rank,
        ep_size=ctx.ep_size,
        etp_rank=ctx.etp_rank,
        etp_size=ctx.etp_size,
        vpp_size=ctx.vpp_size or 1,
    )
    return trainer_shard_map(actor.model_config, chunk_placements(actor.chunks), ctx.rank, at)


def _sources(actor: Actor) -> dict[str, torch.Tensor]:
    return {
        name: param.detach() for chunk in actor.chunks for name, param in chunk_parameters(chunk)
    }


def _plan_if_changed(
    actor: Actor, engine: ShardReceiver | None, sync: ShardSync, bucket_bytes: int
) -> None:
    """Plan again when any rank's map, engine layout or bucket size changed since the plan was
    made (one small all-gather of each rank's key, then, if so, one of the maps): every rank
    ends with the same plan."""
    context = actor.context
    hf_shapes = name_map_for(actor.model_config.model_type).hf_shapes(actor.model_config)
    mine = (trainer_map(actor), None if engine is None else engine.shard_layout(hf_shapes))
    key = hashlib.sha256(pickle.dumps((mine, bucket_bytes))).hexdigest()
    keys: list[Any] = [None] * context.world_size
    dist.all_gather_object(keys, key == sync.key)
    if all(keys) and sync.plan is not None:
        return
    sync.plan, sync.key, sync.workers_hold = None, "", None
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, mine)
    trainer = [shard_map for shard_map, _ in gathered]
    if [layout for _, layout in gathered] != sync.layouts:
        sync.close()  # the group's members change with the engines
    sync.layouts = [layout for _, layout in gathered]
    engines: list[list[ShardMap]] = []
    next_rank = context.world_size
    for rank, layout in enumerate(sync.layouts):
        if layout is None:
            continue
        if layout.in_process:
            if len(layout.maps) != 1:
                raise ValueError(f"rank {rank}: an in-process engine has one map")
            engines.append([_renumbered(layout.maps[0], rank)])
        else:
            engines.append([_renumbered(m, next_rank + m.rank) for m in layout.maps])
            next_rank += len(layout.maps)
    if not engines:
        raise ValueError("shard-to-shard weight sync: no rank holds an engine")
    dtype = _wire_dtype(sync)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    sync.plan = plan_reshard(trainer, engines, element, max(bucket_bytes, element))
    sync.key = key


def _wire_dtype(sync: ShardSync) -> str:
    dtypes = {layout.dtype for layout in sync.layouts if layout is not None}
    if len(dtypes) != 1:
        raise ValueError(f"shard-to-shard weight sync: engines of dtypes {sorted(dtypes)}")
    return next(iter(dtypes))


def _renumbered(shard_map: ShardMap, rank: int) -> ShardMap:
    return ShardMap(rank, shard_map.regions, shard_map.fills, shard_map.local_shapes)


def _build_group(engine: ShardReceiver | None, sync: ShardSync, context: ParallelContext) -> None:
    """The transfer group: trainer rank r is group rank r; each engine's workers follow, replica
    by replica. Trainer rank 0 serves its store."""
    world = context.world_size
    offsets, size = {}, world
    for rank, layout in enumerate(sync.layouts):
        if layout is not None and not layout.in_process:
            offsets[rank], size = size, size + len(layout.maps)
    backend = "nccl" if context.device.type == "cuda" else "gloo"
    store = None
    meeting = [None]
    if context.rank == 0:
        store = dist.TCPStore(
            "0.0.0.0", 0, size, True, sync.timeout, wait_for_workers=False, multi_tenant=True
        )
        meeting = [(_own_address(), store.port, f"bapo-shards-{uuid.uuid4().hex[:12]}")]
    dist.broadcast_object_list(meeting, src=0)
    address, port, name = meeting[0]
    joined = None
    if engine is not None and context.rank in offsets:
        joined = in_background(
            engine.join_transfer_group,
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": offsets[context.rank],
                "world_size": size,
                "group_name": name,
                "backend": backend,
                "timeout_s": sync.timeout.total_seconds(),
            },
        )
    try:
        sync.group = join_weight_group(
            master_address=address,
            master_port=port,
            rank=context.rank,
            world_size=size,
            group_name=name,
            backend=backend,
            timeout=sync.timeout,
            store=store,
        )
    except Exception:
        if joined is not None:  # the engine's call ends too before the engine is called again
            _settled(joined, sync.timeout)
        raise
    sync.group_name, sync._store = name, store
    if joined is not None:
        joined.result(timeout=sync.timeout.total_seconds())


def _own_address() -> str:
    """Where the engine workers reach trainer rank 0's store: ``MASTER_ADDR`` when set (the
    launcher's), else this host's name."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()
