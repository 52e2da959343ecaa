"""The receiving side of an engine on a process of its own that is not a trainer rank (an engine
rank of a disaggregated run, or a stream server's thread driving a server client), as the
trainer's shard-to-shard sync sees it: always workers of their own.

An engine whose workers are processes of their own (vLLM's multiprocess executor, a server) is
passed through. An engine that receives in its own process (the embedded engine, vLLM's
single-process worker) is written by the trainer rank that holds it when colocated; on an
engine rank, that rank's process joins the transfer group itself, as the engine's one worker,
and receives into the engine's tensors.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch

from bapo_megatron.resharding.execute import ReceivingMember
from bapo_megatron.rollout.shard_receiver import ShardLayout, ShardReceiver
from bapo_megatron.rollout.weight_group import join_weight_group, leave_weight_group


class EngineRankReceiver:
    """:class:`~bapo_megatron.rollout.shard_receiver.ShardReceiver` of ``engine`` for a process
    that is not a trainer rank (see the module docstring)."""

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
