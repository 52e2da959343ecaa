"""What an engine rank of a disaggregated run does from start to end: build its engine replica
(any in-process kind of :mod:`bapo_megatron.rollout.registry`), tell its trainer replica
whether that worked, join the weight broadcasts (none when the weights come shard to shard:
the trainer asks for them over the request link) and serve until the trainer stops it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from bapo_megatron.config import Config
from bapo_megatron.config.checks import records_routes
from bapo_megatron.data.task import load_task
from bapo_megatron.disaggregated.engine_gpus import pin_this_process
from bapo_megatron.disaggregated.server import TRAINER, serve
from bapo_megatron.disaggregated.stream_server import StreamServer
from bapo_megatron.disaggregated.world import Role, request_link, result_link, stage_broadcast
from bapo_megatron.distributed.collectives import describe_failure
from bapo_megatron.distributed.startup import RESTART_VARIABLE, restart_count
from bapo_megatron.rollout.registry import build_engine

log = logging.getLogger(__name__)


def run_engine_rank(cfg: Config, role: Role) -> None:
    """Serve engine replica ``role``'s index until the trainer says stop. An engine that cannot
    start reports its error to the trainer (which stops naming it) and raises it here."""
    index = role.split.engine_index(role.rank)
    if RESTART_VARIABLE in os.environ:
        log.info(
            "engine rank %d: torchrun restart count %d (%s): engine replica %d starts anew and "
            "takes its weights from the trainer",
            role.rank,
            restart_count(),
            RESTART_VARIABLE,
            index,
        )
    engine, failure = None, None
    try:
        pin_this_process(cfg.rollout.engine, cfg.rollout.engine_tensor_parallel_size)
        task = load_task(cfg)
        engine = build_engine(
            cfg.rollout,
            task.model,
            model_path=cfg.train.model_path,
            dp_rank=index,
            work_dir=Path(cfg.train.output_dir),
            pad_token_id=task.pad_token_id,
            record_routes=records_routes(cfg, task.model),
        )
    except Exception as error:  # noqa: BLE001 - reported to the trainer, then raised
        failure = error
    requests = request_link(role, cfg.parallel, index)
    requests.send(None if failure is None else describe_failure(failure), TRAINER)
    if failure is not None:
        raise failure
    stages = []
    if cfg.rollout.weight_transport != "shard-to-shard":
        stages = [
            stage_broadcast(role, cfg.parallel, stage)
            for stage in range(cfg.parallel.pipeline_model_parallel_size)
        ]
    if cfg.algorithm.max_staleness:
        results = result_link(role, cfg.parallel, index)
        server = StreamServer(
            engine, requests, results, stages, inflight_update=cfg.rollout.inflight_update
        )
        answered = server.serve()
    else:
        answered = serve(engine, requests, stages)
    log.info("engine replica %d (rank %d) answered %d requests", index, role.rank, answered)
