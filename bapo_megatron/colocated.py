"""Colocated execution: the rollout engine lives on the first rank of each model replica (tensor,
pipeline and context rank 0), next to that rank's part of the actor.

- :func:`push_weights`: the live export gathers each pipeline stage's tensors on the stage's
  first tensor-parallel rank; the other stages send theirs to the engine's rank over the
  pipeline group, and the engine loads them all with the new policy version.
- :func:`share_from_engine_rank`: what the engine rank produced (scored groups, rollout
  statistics) is broadcast to the replica's other ranks, which all need the batch.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from bapo_megatron.actor.build import Actor
from bapo_megatron.parallel import ParallelContext
from bapo_megatron.rollout.protocol import RolloutEngine
from bapo_megatron.weights.export import export_weights


def holds_engine(context: ParallelContext) -> bool:
    """Whether this rank runs its replica's rollout engine."""
    return context.tp_rank == 0 and context.pp_rank == 0 and context.cp_rank == 0


def push_weights(actor: Actor, engine: RolloutEngine | None, *, version: int, bucket_bytes: int,
                 checksum: bool = False) -> str | None:
    """Export the actor's weights into its replica's engine as policy ``version`` (collective
    over the world; ``engine`` is None except on :func:`holds_engine` ranks). Returns the
    engine's checksum of what it loaded (engine rank, with ``checksum``), else None."""
    context = actor.context
    buckets = export_weights(actor.chunks, actor.model_config, context, version=version,
                             bucket_bytes=bucket_bytes)
    # Every TP rank must drain the export (each bucket is a TP collective); only TP rank 0 of
    # each stage receives tensors.
    tensors = [(name, t) for bucket in buckets for name, t in bucket.tensors.items()]
    if context.pp_size > 1:
        if context.tp_rank != 0 or context.cp_rank != 0:
            return None
        # Those ranks form one pipeline group: the later stages send theirs to the first.
        gathered: list[Any] | None = [None] * context.pp_size if context.pp_rank == 0 else None
        dist.gather_object(tensors, gathered, dst=dist.get_global_rank(context.pp_group, 0),
                           group=context.pp_group)
        if context.pp_rank != 0:
            return None
        tensors = [pair for stage in gathered for pair in stage]
    if engine is None:
        return None
    return engine.update_weights(tensors, version=version, checksum=checksum)


def share_from_engine_rank(payload: Any, context: ParallelContext) -> Any:
    """``payload`` of the replica's engine rank, on every rank of the replica (a broadcast over
    the model-parallel group; other ranks pass None)."""
    group = context.process_groups.mp
    if dist.get_world_size(group) == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
