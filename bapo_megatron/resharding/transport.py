"""One bucket of a shard-to-shard plan on the wire: each message packed into one contiguous
buffer from the sender's strided regions, all of a rank's messages of the bucket in one
``torch.distributed.batch_isend_irecv`` call, and each received buffer unpacked into the
receiver's tensors.

Ranks are ranks of the transfer group (``group_peer``), so the group may be any subgroup of the
world. The buffers live on the local tensors' device: gloo moves CPU tensors, NCCL CUDA ones.
A message a rank sends itself is copied in place, without a buffer.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from bapo_megatron.resharding.plan import Copy, Message


class BufferKind(NamedTuple):
    """What a rank's message buffers are: the wire dtype, on the rank's device."""

    dtype: torch.dtype
    device: torch.device


@dataclass
class BucketTraffic:
    """Bytes and messages one rank sent and received in one bucket (its own copies excluded)."""

    sent_bytes: int = 0
    received_bytes: int = 0
    sent_messages: int = 0
    received_messages: int = 0


def copy_view(flat: torch.Tensor, offset: int, rows: int, cols: int, stride: int) -> torch.Tensor:
    """The ``[rows, cols]`` view of a flat tensor's runs: ``rows`` runs of ``cols`` elements,
    ``stride`` apart, the first at element ``offset``."""
    return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + offset)


def source_view(sources: Mapping[str, torch.Tensor], copy: Copy) -> torch.Tensor:
    flat = sources[copy.source].view(-1)
    return copy_view(flat, copy.source_offset, copy.rows, copy.cols, copy.source_stride)


def target_view(targets: Mapping[str, torch.Tensor], copy: Copy) -> torch.Tensor:
    flat = targets[copy.target].view(-1)
    return copy_view(flat, copy.target_offset, copy.rows, copy.cols, copy.target_stride)


def pack(message: Message, sources: Mapping[str, torch.Tensor], kind: BufferKind) -> torch.Tensor:
    """One contiguous buffer (of ``kind``) holding ``message``'s copies in order, each row by
    row (converted to the wire dtype)."""
    buffer = torch.empty(message.numel, dtype=kind.dtype, device=kind.device)
    start = 0
    for copy in message.copies:
        buffer[start : start + copy.numel].view(copy.rows, copy.cols).copy_(
            source_view(sources, copy)
        )
        start += copy.numel
    return buffer


def unpack(message: Message, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Write a received ``buffer`` (as :func:`pack` made it) into the receiver's tensors
    (converted to their dtype)."""
    start = 0
    for copy in message.copies:
        target_view(targets, copy).copy_(
            buffer[start : start + copy.numel].view(copy.rows, copy.cols)
        )
        start += copy.numel


def exchange_bucket(
    bucket: Sequence[Message],
    rank: int,
    sources: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    kind: BufferKind,
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
) -> BucketTraffic:
    """Send and receive ``rank``'s messages of one bucket in one batched point-to-point call and
    write what arrives; returns what moved. Every wait is bounded by ``timeout``. A message that
    is one contiguous run on its side of the wire travels from or into the local tensor itself
    (:func:`in_place`); the other buffers are dropped on return, so at most one bucket of them
    is alive."""
    traffic = BucketTraffic()
    ops: list[dist.P2POp] = []
    arriving: list[tuple[Message, torch.Tensor]] = []
    element_bytes = torch.empty((), dtype=kind.dtype).element_size()
    for message in bucket:
        if message.sender == rank and message.receiver == rank:
            for copy in message.copies:
                target_view(targets, copy).copy_(source_view(sources, copy))
        elif message.sender == rank:
            buffer = in_place(message, sources, kind, "source")
            if buffer is None:
                buffer = pack(message, sources, kind)
            ops.append(dist.P2POp(dist.isend, buffer, group=group, group_peer=message.receiver))
            traffic.sent_bytes += buffer.numel() * element_bytes
            traffic.sent_messages += 1
        elif message.receiver == rank:
            buffer = in_place(message, targets, kind, "target")
            if buffer is None:
                buffer = torch.empty(message.numel, dtype=kind.dtype, device=kind.device)
                arriving.append((message, buffer))
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=message.sender))
            traffic.received_bytes += buffer.numel() * element_bytes
            traffic.received_messages += 1
    if not ops:
        return traffic
    for work in dist.batch_isend_irecv(ops):
        if not work.wait(timeout):
            raise TimeoutError(f"a point-to-point transfer did not end within {timeout}")
    for message, buffer in arriving:
        unpack(message, buffer, targets)
    return traffic


def in_place(
    message: Message, tensors: Mapping[str, torch.Tensor], kind: BufferKind, side: str
) -> torch.Tensor | None:
    """The message's elements as one contiguous slice of the local tensor, when the message is
    one copy whose runs follow each other there and the tensor already has the wire dtype: sent
    from, or received into, directly (no buffer, no copy). None otherwise."""
    if len(message.copies) != 1:
        return None
    copy = message.copies[0]
    name, offset, stride = (
        (copy.source, copy.source_offset, copy.source_stride)
        if side == "source"
        else (copy.target, copy.target_offset, copy.target_stride)
    )
    tensor = tensors[name]
    if tensor.dtype != kind.dtype or tensor.device != kind.device:
        return None
    if copy.rows > 1 and stride != copy.cols:
        return None
    return tensor.view(-1)[offset : offset + copy.numel]
