"""The trainer ranks' end of a disaggregated run: which rank holds the engine client and which
ranks send weights, connected once before training (:func:`connect_engines`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from bapo_megatron.config import Config
from bapo_megatron.disaggregated.client import ENGINE, RemoteEngine
from bapo_megatron.disaggregated.server import IDLE_LIMIT
from bapo_megatron.disaggregated.stream_client import StreamingEngine
from bapo_megatron.disaggregated.world import Role, request_link, result_link, stage_broadcast
from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.weight_sync.stage_broadcast_wire import StageBroadcast


@dataclass
class EngineLink:
    """This trainer rank's part of the links to the engine ranks."""

    engine: GuardedEngine | None
    """The replica's engine client, on its first rank (tensor, pipeline, context rank 0)."""
    weights: StageBroadcast | None
    """This stage's weight broadcast, on replica 0's export ranks of stages after the first
    (the first stage's is inside the engine client)."""
    stream: StreamingEngine | None = None
    """Asynchronous training (``algorithm.max_staleness`` >= 1): the replica's streaming client
    on its first rank, in place of ``engine``."""
    local: bool = False
    """The engines are servers driven from a thread of the trainer's ranks
    (:mod:`~bapo_megatron.disaggregated.local_link`): weights take the colocated export route
    into ``stream``."""

    @property
    def sent_bytes(self) -> int:
        """Weight bytes this rank has broadcast to the engines so far."""
        stages = [self.weights, self.stream.weights if self.stream is not None else None]
        return sum(stage.sent_bytes for stage in stages if stage is not None)

    def close(self) -> None:
        """Stop this replica's engine rank (on the rank that holds the client)."""
        if self.engine is not None:
            self.engine.engine.close()
        if self.stream is not None:
            self.stream.close()


def connect_engines(cfg: Config, context: ParallelContext, role: Role) -> EngineLink:
    """Join the request link (replica's first rank) and the weight broadcasts (replica 0's
    export ranks; none when the weights go shard to shard); collective over the trainer world.
    An engine rank that could not build its engine stops every trainer rank with
    :class:`EngineFailure` naming it."""
    first = context.tp_rank == 0 and context.pp_rank == 0 and context.cp_rank == 0
    link = request_link(role, cfg.parallel, context.dp_rank) if first else None
    failure = None
    if link is not None:
        reported = link.recv(ENGINE)
        if reported is not None:
            failure = EngineFailure(f"{link.names[ENGINE]} could not start: {reported}")
    raise_if_any_rank_failed(
        failure, where="stopped while connecting the engine ranks", error_type=EngineFailure
    )
    sends = context.dp_rank == 0 and context.tp_rank == 0 and context.cp_rank == 0
    sends = sends and cfg.rollout.weight_transport != "shard-to-shard"
    weights = stage_broadcast(role, cfg.parallel, context.pp_rank) if sends else None
    engine = stream = None
    timeout = cfg.rollout.timeout_s
    if link is not None and cfg.algorithm.max_staleness:
        stream = StreamingEngine(
            link,
            result_link(role, cfg.parallel, context.dp_rank),
            weights=weights if context.pp_rank == 0 else None,
            bucket_bytes=cfg.rollout.weight_bucket_mib * 2**20,
            timeout=datetime.timedelta(seconds=timeout) if timeout else IDLE_LIMIT,
            name=f"rollout engine {cfg.rollout.engine!r} on {link.names[ENGINE]}",
        )
    elif link is not None:
        client = RemoteEngine(
            link,
            weights=weights if context.pp_rank == 0 else None,
            bucket_bytes=cfg.rollout.weight_bucket_mib * 2**20,
            generation_timeout=datetime.timedelta(seconds=timeout) if timeout else IDLE_LIMIT,
        )
        # the client enforces the deadline itself (an engine on another rank cannot be aborted
        # from here); the guard names it in every failure
        engine = GuardedEngine(
            client, name=f"rollout engine {cfg.rollout.engine!r} on {link.names[ENGINE]}"
        )
    return EngineLink(
        engine=engine,
        weights=weights if context.pp_rank > 0 else None,
        stream=stream,
    )
