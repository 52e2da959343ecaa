"""The shard-to-shard sync (``rollout.weight_transport: shard-to-shard``) across a request link:
the engine's side answers the requests with
:class:`~bapo_megatron.rollout.shard_member.EngineRankReceiver`, the trainer's clients ask them
through :class:`RemoteShardReceiving`, so that
:func:`~bapo_megatron.weights.shard_sync.push_shards` drives an engine on another rank (or a
stream server's thread) as it drives a colocated one whose workers are processes of their own.
"""

from __future__ import annotations

import datetime
from typing import Any

from bapo_megatron.distributed.collectives import describe_failure
from bapo_megatron.rollout.shard_member import EngineRankReceiver
from bapo_megatron.rollout.shard_receiver import ShardLayout

SHARD_REQUESTS = ("shard_layout", "join_transfer_group", "receive_shards")
"""Request kinds answered by :func:`answer_shard_request`."""


def answer_shard_request(receiver: EngineRankReceiver, request: tuple) -> tuple[str, Any]:
    """``("ok", value)`` or ``("error", what failed)`` for one request of
    :data:`SHARD_REQUESTS`."""
    kind = request[0]
    try:
        if kind == "shard_layout":
            return "ok", receiver.shard_layout(request[1])
        if kind == "join_transfer_group":
            receiver.join_transfer_group(request[1])
            return "ok", None
        if kind == "receive_shards":
            return "ok", receiver.receive_shards(request[1], version=int(request[2]))
    except Exception as error:  # noqa: BLE001 - answered: the trainer stops naming this engine
        return "error", describe_failure(error)
    return "error", f"unknown shard request {kind!r}"


class RemoteShardReceiving:
    """The trainer's side: mixed into the clients of an engine on another rank, which provide
    ``_shard_call(request, timeout)`` (send a request, return the engine's answer or raise its
    error). The layout is asked once per set of HF shapes and kept."""

    version: int
    _shards_layout: tuple[dict[str, tuple[int, ...]], ShardLayout] | None = None

    def _shard_call(self, request: tuple, timeout: datetime.timedelta | None) -> Any:
        raise NotImplementedError

    def shard_layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> ShardLayout:
        if self._shards_layout is None or self._shards_layout[0] != hf_shapes:
            layout = self._shard_call(("shard_layout", dict(hf_shapes)), None)
            self._shards_layout = (dict(hf_shapes), layout)
        return self._shards_layout[1]

    def join_transfer_group(self, request: dict[str, Any]) -> None:
        self._shard_call(("join_transfer_group", request), _deadline(request))

    def receive_shards(self, request: dict[str, Any], *, version: int) -> list[dict[str, Any]]:
        reports = self._shard_call(("receive_shards", request, int(version)), _deadline(request))
        self.version = int(version)
        return reports


def _deadline(request: dict[str, Any]) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(request["timeout_s"]))
