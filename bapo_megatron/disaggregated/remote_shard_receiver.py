"""The shard receiver of an engine on another process than the trainer rank that drives it (an
engine rank of a disaggregated run, or a stream server's thread driving a server client), both
ends of the request link (``rollout.weight_transport: shard-to-shard``): the trainer's clients
ask through :class:`RemoteShardReceiving`, the engine's side answers with
:func:`answer_shard_request` and :class:`EngineRankReceiver`, so that
:func:`~bapo_megatron.weight_sync.shard_to_shard.push_shards` drives such an engine as it drives
a colocated one whose workers are processes of their own.

On the engine's side the workers are always of their own, as the trainer sees them. An engine
whose workers are processes of their own (vLLM's multiprocess executor, a server) is passed
through. An engine that receives in its own process (the embedded engine, vLLM's single-process
worker) is written by the trainer rank that holds it when colocated; here, this process joins
the transfer group itself, as the engine's one worker, and receives into the engine's tensors.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch

from bapo_megatron.distributed.collectives import describe_failure
from bapo_megatron.resharding.execute import ReceivingMember
from bapo_megatron.rollout.shard_receiver_protocol import ShardLayout, ShardReceiver
from bapo_megatron.rollout.weight_group import join_weight_group, leave_weight_group

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


class EngineRankReceiver:
    """The engine rank's side: the
    :class:`~bapo_megatron.rollout.shard_receiver_protocol.ShardReceiver` of ``engine`` for a
    process that is not a trainer rank (see the module docstring)."""

    def __init__(self, engine: ShardReceiver) -> None:
        self.engine = engine
        self._itself: bool | None = None
        """The engine receives in this process (None: not known before the first layout)."""
        self._group: torch.distributed.ProcessGroup | None = None
        self._backend = "gloo"
        self._member = ReceivingMember()

    def shard_layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> ShardLayout:
        layout = self.engine.shard_layout(hf_shapes)
        self._itself = layout.in_process
        if not layout.in_process:
            return layout
        (own,) = layout.maps
        one_worker = dataclasses.replace(own, rank=0)
        return ShardLayout((one_worker,), layout.dtype, in_process=False, instance=layout.instance)

    def join_transfer_group(self, request: dict[str, Any]) -> None:
        if not self._receives_itself():
            self.engine.join_transfer_group(request)
            return
        self._leave()
        self._group = join_weight_group(
            master_address=request["master_address"],
            master_port=int(request["master_port"]),
            rank=int(request["rank_offset"]),
            world_size=int(request["world_size"]),
            group_name=request["group_name"],
            backend=request["backend"],
            timeout=datetime.timedelta(seconds=float(request["timeout_s"])),
        )
        self._backend = request["backend"]

    def receive_shards(self, request: dict[str, Any], *, version: int) -> list[dict[str, Any]]:
        if not self._receives_itself():
            return self.engine.receive_shards(request, version=version)
        if self._group is None:
            raise RuntimeError("receive_shards before join_transfer_group")
        device = "cpu" if self._backend == "gloo" else torch.device("cuda")
        try:
            counts = self._member.receive(self._group, request, self.engine.shard_targets, device)
        except BaseException:
            self._leave()  # a gloo group whose transfer failed is unusable: the next joins anew
            raise
        checksum = self.engine.shards_received(version=version, checksum=request["checksum"])
        return [{"received_bytes": counts.received_bytes, "checksum": checksum}]

    def close(self) -> None:
        self._leave()

    def _receives_itself(self) -> bool:
        if self._itself is None:
            raise RuntimeError("the engine's shard layout is read before it joins a transfer")
        return self._itself

    def _leave(self) -> None:
        if self._group is not None:
            leave_weight_group(self._group)
            self._group = None
