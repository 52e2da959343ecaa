"""Colocated execution: the rollout engine lives on the first rank of each model replica (tensor,
pipeline and context rank 0), next to that rank's part of the actor.

- the weights reach the engine by :func:`bapo_megatron.weights.sync.push_weights`.
- :func:`share_from_engine_rank`: what the engine rank produced (scored groups, rollout
  statistics) is broadcast to the replica's other ranks, which all need the batch.
- :func:`stop_if_any_engine_failed`: an engine rank that failed tells every rank of the run, so
  they all stop with its error instead of waiting in a collective for a rank that is gone.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.guard import EngineFailure


def holds_engine(context: ParallelContext) -> bool:
    """Whether this rank runs its replica's rollout engine."""
    return context.tp_rank == 0 and context.pp_rank == 0 and context.cp_rank == 0


def stop_if_any_engine_failed(failure: BaseException | None, context: ParallelContext, *,
                              during: str) -> None:
    """Collective over the world: raise :class:`EngineFailure` on every rank if any rank passes
    a ``failure`` (its engine's error; None elsewhere)."""
    raise_if_any_rank_failed(failure, where=f"stopped during {during}", error_type=EngineFailure)


def share_from_engine_rank(payload: Any, context: ParallelContext) -> Any:
    """``payload`` of the replica's engine rank, on every rank of the replica (a broadcast over
    the model-parallel group; other ranks pass None)."""
    group = context.process_groups.mp
    if dist.get_world_size(group) == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
