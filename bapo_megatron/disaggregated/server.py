"""The engine rank's serving loop: requests from its trainer replica, answered one at a time.

Requests (from :class:`~bapo_megatron.disaggregated.client.RemoteEngine`): ``generate``,
``continue``, ``health``, ``update_weights``, the shard-to-shard sync's
(:mod:`~bapo_megatron.disaggregated.remote_shard_receiver`) and ``stop``. An engine call that
fails is answered with the error (the trainer stops naming this engine); a link that fails (the
trainer went away, or a deadline passed) ends the loop with
:class:`~bapo_megatron.distributed.messages.PeerLost`.

Weight updates are all or nothing: the tensors of every pipeline stage are received completely
(each stage's end header counted) before any is loaded, so a broadcast cut off part-way leaves
the engine on its previous complete version. Engines that keep a prefix/KV cache across calls
reset it inside their ``update_weights`` (the vLLM adapter calls ``reset_prefix_cache``); the
embedded engine keeps none between calls (its KV cache lives for one ``generate``), so nothing
cached under one version is reused under the next.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

from bapo_megatron.disaggregated.remote_shard_receiver import (
    SHARD_REQUESTS,
    EngineRankReceiver,
    answer_shard_request,
)
from bapo_megatron.distributed.collectives import describe_failure
from bapo_megatron.distributed.messages import GroupMessenger
from bapo_megatron.rollout.protocol import RolloutEngine
from bapo_megatron.weight_sync.stage_broadcast_wire import IncompleteStage, StageBroadcast

log = logging.getLogger(__name__)

TRAINER = 0
"""Group rank of the trainer's end of a request link."""

IDLE_LIMIT = datetime.timedelta(days=1)
"""How long an engine rank waits for its next request. The trainer may train for long between
requests; a trainer that exits (cleanly or killed) closes the link, which ends the wait at once,
so this bound only matters for a trainer that hangs without dying."""


def serve(
    engine: RolloutEngine,
    requests: GroupMessenger,
    stages: Sequence[StageBroadcast],
    *,
    idle_limit: datetime.timedelta = IDLE_LIMIT,
) -> int:
    """Answer ``requests`` with ``engine`` until ``stop``; returns the number of requests
    answered. ``stages`` are the weight broadcasts of the trainer's pipeline stages, in order
    (none when the weights come shard to shard)."""
    answered = 0
    receiver = EngineRankReceiver(engine)
    try:
        while True:
            request = requests.recv(TRAINER, timeout=idle_limit)
            kind = request[0]
            if kind == "stop":
                log.info("engine rank stopped by its trainer after %d requests", answered)
                return answered
            if kind == "update_weights":
                _, version, checksum = request
                reply = _update(engine, stages, version=version, checksum=checksum)
            elif kind in SHARD_REQUESTS:
                reply = answer_shard_request(receiver, request)
            else:
                reply = _answer(engine, request)
            requests.send(reply, TRAINER)
            answered += 1
    finally:
        receiver.close()


def _answer(engine: RolloutEngine, request: tuple) -> tuple[str, Any]:
    kind = request[0]
    try:
        if kind == "generate":
            _, prompts, params, round_tokens = request
            return "ok", engine.generate(prompts, params, round_tokens=round_tokens)
        if kind == "continue":
            _, samples, params, round_tokens = request
            return "ok", engine.continue_generation(samples, params, round_tokens=round_tokens)
        if kind == "health":
            return "ok", engine.health()
    except Exception as error:  # noqa: BLE001 - answered: the trainer stops naming this engine
        return "error", describe_failure(error)
    return "error", f"unknown request {kind!r}"


def _update(
    engine: RolloutEngine, stages: Sequence[StageBroadcast], *, version: int, checksum: bool
) -> tuple[str, Any]:
    """Receive every stage completely, then load (see :func:`receive_version`)."""
    staged, problem = receive_version(stages, version)
    if problem is not None:
        return "error", problem
    try:
        return "ok", engine.update_weights(staged, version=version, checksum=checksum)
    except Exception as error:  # noqa: BLE001 - answered: the trainer stops naming this engine
        return "error", describe_failure(error)


def receive_version(
    stages: Sequence[StageBroadcast], version: int
) -> tuple[list[tuple[str, Any]], str | None]:
    """Every stage's tensors of weight update ``version``, received completely before anything
    is loaded, and what was wrong with them (None: nothing). A stage whose sender disappears
    raises :class:`PeerLost` here (passed on: the link is gone), before anything is loaded."""
    staged = []
    problems = []
    for stage in stages:
        try:
            tensors, stamped = stage.receive()
        except IncompleteStage as error:  # the stream stays in step: answer, do not load
            problems.append(describe_failure(error))
            continue
        if stamped != version:
            problems.append(
                f"pipeline stage {stage.stage} sent version {stamped}, the request was {version}"
            )
        staged.extend(tensors)
    if problems:
        return staged, f"weight update to version {version} refused: " + "; ".join(problems)
    return staged, None
