"""The shard-to-shard sync's transfer group: every trainer rank, then the workers of each engine
that receives in processes of its own, joined once per set of engines
(:func:`build_transfer_group`) the way :func:`~bapo_megatron.rollout.weight_group.join_weight_group`
builds a weight group (a TCP store served by trainer rank 0, a process group beside the world's).
An engine that receives in a trainer rank's process joins nothing: that rank receives for it, in
the world group.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch.distributed as dist

from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.shard_receiver_protocol import ShardReceiver
from bapo_megatron.rollout.weight_group import in_background, join_weight_group
from bapo_megatron.weight_sync.shard_plan_cache import ShardSync


def build_transfer_group(
    engine: ShardReceiver | None, sync: ShardSync, context: ParallelContext
) -> None:
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
            settled(joined, sync.timeout)
        raise
    sync.group_name, sync._store = name, store
    if joined is not None:
        joined.result(timeout=sync.timeout.total_seconds())


def _own_address() -> str:
    """Where the engine workers reach trainer rank 0's store: ``MASTER_ADDR`` when set (the
    launcher's), else this host's name."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


def settled(future: Future, timeout: datetime.timedelta) -> None:
    """Wait for ``future`` to end, whatever its outcome, at most ``timeout``."""
    wait_futures([future], timeout=timeout.total_seconds())
