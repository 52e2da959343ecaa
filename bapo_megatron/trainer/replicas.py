"""Colocated execution: the rollout engine lives on the first rank of each model replica (tensor,
pipeline and context rank 0), next to that rank's part of the actor.

- the weights reach the engine by :func:`bapo_megatron.weight_sync.colocated_stream.push_weights`.
- :func:`share_from_engine_rank`: what the engine rank produced (scored groups, rollout
  statistics) is broadcast to the replica's other ranks, which all need the batch.
- :func:`stop_if_any_engine_failed` (and :func:`engine_failures_stop_every_rank`,
  :func:`call_engine` around engine-rank work): an engine rank that failed tells every rank of
  the run, so they all stop with its error instead of waiting in a collective for a rank that is
  gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.rollout.protocol import RolloutEngine


def holds_engine(context: ParallelContext) -> bool:
    """Whether this rank runs its replica's rollout engine."""
    return context.tp_rank == 0 and context.pp_rank == 0 and context.cp_rank == 0


def stop_if_any_engine_failed(
    failure: BaseException | None, context: ParallelContext, *, during: str
) -> None:
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


def call_engine(
    engine: RolloutEngine | None,
    call: Callable[[RolloutEngine], object],
    context: ParallelContext,
    *,
    during: str,
) -> None:
    """Collective over the world: ``call(engine)`` on the engine ranks (``engine`` is None
    elsewhere); if it raises on any rank, every rank raises :class:`EngineFailure` naming
    ``during`` (which names the call) and the error."""
    with engine_failures_stop_every_rank(context, during=during):
        if engine is not None:
            call(engine)


def share_from_engine_rank(payload: Any, context: ParallelContext) -> Any:
    """``payload`` of the replica's engine rank, on every rank of the replica (a broadcast over
    the model-parallel group; other ranks pass None)."""
    group = context.process_groups.mp
    if dist.get_world_size(group) == 1:
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
