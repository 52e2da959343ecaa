"""The stage broadcast's wire, both ends: one pipeline stage's HF-named tensors broadcast from the
stage's export rank to every engine replica (disaggregated placement), in bounded buckets. The
engine links build one per stage (:mod:`bapo_megatron.disaggregated.world`); the trainer sends
with :meth:`StageBroadcast.send` (:mod:`.stage_broadcast`, and the engine client for stage 0),
the engine ranks receive with :meth:`StageBroadcast.receive`
(:mod:`bapo_megatron.disaggregated.server`).

Each stage has a group of its own (:class:`StageBroadcast`: the stage's export rank is group
rank 0, engine replica ``i`` is group rank ``i + 1``), so every stage sends its own layers and no
trainer rank holds more than its stage and a bucket. Per bucket, the stage broadcasts a header
(names, shapes, the wire dtype) and then one flat buffer of the bucket's tensors converted to
the wire dtype (the engine's dtype: the conversion happens before the bytes travel). A final
header carries the policy version and the number of tensors sent: a receiver that reaches it has
the stage complete; one whose sender disappears part-way gets :class:`PeerLost` instead, and the
engine keeps its previous complete version (:mod:`bapo_megatron.disaggregated.server`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from bapo_megatron.distributed.messages import GroupMessenger

SENDER = 0
"""Group rank of the stage's export rank."""


class IncompleteStage(RuntimeError):
    """A stage's stream ended without the tensors its final header announced."""


@dataclass
class StageBroadcast:
    """The broadcast group of pipeline stage ``stage``: its export rank and the engines."""

    messenger: GroupMessenger
    stage: int
    sent_bytes: int = 0
    """Bytes this export rank has broadcast so far (the weight-update metrics)."""
    data: GroupMessenger | None = None
    """A second group of the same members for the flat buffers (NCCL between GPUs), the
    headers staying on ``messenger`` (gloo: pickled objects travel as CPU bytes); None: the
    buffers go over ``messenger`` too."""
    device: str = "cpu"
    """Where the flat buffers live while they travel (``cuda`` with an NCCL ``data`` group)."""

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        bucket_bytes: int,
        wire_dtype: torch.dtype | None = None,
    ) -> int:
        """Broadcast ``named_tensors`` (export rank only) in buckets of at most
        ``bucket_bytes`` on the wire (a larger tensor travels alone), each tensor converted to
        ``wire_dtype`` (default: its own), then the end of the stage stamped ``version``.
        Returns the bytes sent."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        bucket: list[tuple[str, torch.Tensor]] = []
        filled = sent = count = 0
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            if wire_dtype is not None:
                tensor = tensor.to(wire_dtype)
            size = tensor.numel() * tensor.element_size()
            mixed = bucket and bucket[0][1].dtype != tensor.dtype
            if bucket and (filled + size > bucket_bytes or mixed):
                sent += self._send_bucket(bucket)
                bucket, filled = [], 0
            bucket.append((name, tensor))
            filled += size
            count += 1
        if bucket:
            sent += self._send_bucket(bucket)
        self.messenger.broadcast_object(
            {"end": True, "version": int(version), "tensors": count}, SENDER
        )
        self.sent_bytes += sent
        return sent

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        dtype = bucket[0][1].dtype
        header = {"end": False, "dtype": dtype, "tensors": [(n, tuple(t.shape)) for n, t in bucket]}
        self.messenger.broadcast_object(header, SENDER)
        flat = torch.cat([t.reshape(-1).to(self.device) for _, t in bucket]).contiguous()
        (self.data or self.messenger).broadcast_tensor(flat, SENDER)
        return flat.numel() * flat.element_size()

    def receive(self) -> tuple[list[tuple[str, torch.Tensor]], int]:
        """The stage's tensors (engine ranks) and the version its end header carries. Raises
        :class:`PeerLost` if the sender goes away part-way, :class:`IncompleteStage` if the
        count announced at the end is not what arrived."""
        received: list[tuple[str, torch.Tensor]] = []
        while True:
            header = self.messenger.broadcast_object(None, SENDER)
            if header["end"]:
                break
            received.extend(self._receive_bucket(header))
        if header["tensors"] != len(received):
            raise IncompleteStage(
                f"pipeline stage {self.stage} announced {header['tensors']} tensors for version "
                f"{header['version']}, {len(received)} arrived"
            )
        return received, int(header["version"])

    def _receive_bucket(self, header: dict) -> Iterator[tuple[str, torch.Tensor]]:
        shapes = [shape for _, shape in header["tensors"]]
        flat = torch.empty(
            sum(math.prod(s) for s in shapes), dtype=header["dtype"], device=self.device
        )
        (self.data or self.messenger).broadcast_tensor(flat, SENDER)
        offset = 0
        for (name, shape), numel in zip(header["tensors"], map(math.prod, shapes)):
            yield name, flat[offset : offset + numel].view(shape)
            offset += numel
