"""The shard-to-shard plan: from the trainer's and the engines' shard maps, which rectangles each
trainer rank sends to each engine worker, bucket by bucket.

A pure function of the gathered maps (:func:`plan_reshard`), so every rank computes the same plan
and checks its :attr:`ReshardPlan.digest` before any byte moves. Each element an engine worker
holds is sent to it once, from one trainer rank that holds it: the holders of a rectangle are the
trainer's data-parallel replicas and, for a tensor every tensor-parallel rank keeps whole, those
ranks too; each rectangle is taken from the receiver itself when it is a holder (an engine that
lives in a trainer rank's process), else from the holder that has sent the fewest bytes so far,
so the load spreads over them. Elements an engine holds but no HF tensor has (vocabulary
padding) are the plan's fills: the receiver zeroes them. A bucket holds at most
``bucket_bytes`` of what any one rank sends and of what any one rank receives; a rectangle
larger than that is cut into rows (or, for a single row, columns) that fit.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from bapo_megatron.models.shard_map import Fill, Region, ShardMap


class Copy(NamedTuple):
    """One rectangle of an HF tensor, from the sender's local tensor into the receiver's: ``rows``
    runs of ``cols`` elements, each side with its own first element and distance between runs."""

    hf: str
    rows: int
    cols: int
    source: str
    source_offset: int
    source_stride: int
    target: str
    target_offset: int
    target_stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class Message:
    """What one sender sends one receiver in one bucket."""

    sender: int
    receiver: int
    copies: tuple[Copy, ...]

    @property
    def numel(self) -> int:
        return sum(copy.numel for copy in self.copies)


@dataclass(frozen=True)
class ReshardPlan:
    """Messages per bucket, the receivers' fills, and the digest every rank compares."""

    buckets: tuple[tuple[Message, ...], ...]
    fills: tuple[tuple[int, tuple[Fill, ...]], ...]
    """``(receiver, its fills)``, by receiver."""
    element_bytes: int
    bucket_bytes: int
    digest: str
    """SHA-256 of everything above: equal on two ranks if and only if their plans are."""

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each sender sends per update (copies to itself excluded)."""
        return self._bytes_by(lambda message: message.sender)

    def received_bytes(self) -> dict[int, int]:
        """Bytes each receiver receives per update (copies from itself excluded)."""
        return self._bytes_by(lambda message: message.receiver)

    def targets_of(self, receiver: int) -> set[str]:
        """Names of the local tensors ``receiver``'s copies and fills write."""
        names = {
            copy.target
            for bucket in self.buckets
            for message in bucket
            if message.receiver == receiver
            for copy in message.copies
        }
        return names | {
            fill.local for rank, fills in self.fills if rank == receiver for fill in fills
        }

    @property
    def message_count(self) -> int:
        return sum(len(bucket) for bucket in self.buckets)

    def _bytes_by(self, key) -> dict[int, int]:
        total: dict[int, int] = defaultdict(int)
        for bucket in self.buckets:
            for message in bucket:
                if message.sender != message.receiver:  # a copy in place moves nothing
                    total[key(message)] += message.numel * self.element_bytes
        return dict(sorted(total.items()))


def plan_reshard(
    trainer: Sequence[ShardMap],
    engines: Sequence[Sequence[ShardMap]],
    element_bytes: int,
    bucket_bytes: int,
) -> ReshardPlan:
    """The plan that fills every worker of every engine replica (``engines[i]``: the maps of
    replica i's workers) from the ``trainer`` ranks' shards (every rank that holds any, all
    data-parallel replicas). ``ValueError`` naming the tensor and ranks when the trainer's
    rectangles overlap or an engine worker holds an element no trainer rank does."""
    if element_bytes < 1 or bucket_bytes < element_bytes:
        raise ValueError(
            f"plan_reshard: bucket_bytes ({bucket_bytes}) must hold at least one element of "
            f"{element_bytes} bytes"
        )
    sources = _holders(trainer)
    receivers = sorted((m for replica in engines for m in replica), key=lambda m: m.rank)
    if len({m.rank for m in receivers}) != len(receivers):
        raise ValueError("plan_reshard: two engine workers share a rank")
    sent: dict[int, int] = defaultdict(int)
    copies: list[tuple[int, int, Copy]] = []
    by_tensor = [_by_tensor(receiver) for receiver in receivers]
    for hf in _tensor_order(receivers):
        for receiver, regions in zip(receivers, by_tensor):
            for target in regions.get(hf, ()):
                copies += _fill_region(target, receiver.rank, sources.get(hf, {}), sent)
    buckets = _buckets(
        (piece for copy in copies for piece in _cut(copy, bucket_bytes // element_bytes)),
        bucket_bytes // element_bytes,
    )
    fills = tuple((m.rank, m.fills) for m in receivers if m.fills)
    content = (buckets, fills, element_bytes, bucket_bytes)
    return ReshardPlan(buckets, fills, element_bytes, bucket_bytes, _digest(content))


def _holders(trainer: Sequence[ShardMap]) -> dict[str, dict[tuple, list[tuple[int, Region]]]]:
    """HF tensor -> its distinct rectangles -> ``(rank, region)`` of every holder, by rank;
    ``ValueError`` when two distinct rectangles of one tensor overlap."""
    holders: dict[str, dict[tuple, list[tuple[int, Region]]]] = defaultdict(dict)
    for shard_map in sorted(trainer, key=lambda m: m.rank):
        for region in shard_map.regions:
            holders[region.hf].setdefault(region.box, []).append((shard_map.rank, region))
    for hf, boxes in holders.items():
        found = sorted(boxes)
        for i, a in enumerate(found):
            for b in found[i + 1 :]:
                if boxes[a][0][1].within(*b[1:]) is not None:
                    raise ValueError(
                        f"plan_reshard: {hf}: trainer rank {boxes[a][0][0]} holds rows "
                        f"{a[1]}:{a[1] + a[3]}, cols {a[2]}:{a[2] + a[4]}, which overlap rank "
                        f"{boxes[b][0][0]}'s rows {b[1]}:{b[1] + b[3]}, cols {b[2]}:{b[2] + b[4]}"
                    )
    return holders


def _by_tensor(shard_map: ShardMap) -> dict[str, list[Region]]:
    regions: dict[str, list[Region]] = defaultdict(list)
    for region in shard_map.regions:
        regions[region.hf].append(region)
    return regions


def _tensor_order(receivers: Sequence[ShardMap]) -> list[str]:
    """HF tensors in the order the lowest engine rank holding them lists them."""
    order: dict[str, None] = {}
    for shard_map in sorted(receivers, key=lambda m: m.rank):
        order.update((region.hf, None) for region in shard_map.regions)
    return list(order)


def _fill_region(
    target: Region,
    receiver: int,
    boxes: dict[tuple, list[tuple[int, Region]]],
    sent: dict[int, int],
) -> Iterator[tuple[int, int, Copy]]:
    """``(sender, receiver, copy)`` of every piece of ``target``, each from the receiver itself
    when it holds the trainer rectangle the piece lies in, else from its least-loaded holder."""
    covered = 0
    for holders in boxes.values():
        part = holders[0][1].within(target.row, target.col, target.rows, target.cols)
        if part is None:
            continue
        # a receiver that holds the rectangle itself (an engine in a trainer rank's process)
        # copies it in place; otherwise the least-loaded holder sends
        rank, source = min(
            holders, key=lambda holder: (holder[0] != receiver, sent[holder[0]], holder[0])
        )
        sent[rank] += part.numel
        covered += part.numel
        src = source.within(part.row, part.col, part.rows, part.cols)
        dst = target.within(part.row, part.col, part.rows, part.cols)
        yield (
            rank,
            receiver,
            Copy(
                target.hf,
                part.rows,
                part.cols,
                src.local,
                src.offset,
                src.row_stride,
                dst.local,
                dst.offset,
                dst.row_stride,
            ),
        )
    if covered != target.numel:
        raise ValueError(
            f"plan_reshard: engine rank {receiver} holds {target.numel - covered} elements of "
            f"{target.hf} (rows {target.row}:{target.row + target.rows}, cols "
            f"{target.col}:{target.col + target.cols}) that no trainer rank holds"
        )


def _cut(item: tuple[int, int, Copy], limit: int) -> Iterator[tuple[int, int, Copy]]:
    """``item``'s copy in pieces of at most ``limit`` elements: blocks of rows, and a row longer
    than ``limit`` in blocks of columns."""
    sender, receiver, copy = item
    if copy.numel <= limit:
        yield item
        return
    if copy.cols > limit:
        for row in range(copy.rows):
            for col in range(0, copy.cols, limit):
                yield sender, receiver, _piece(copy, row, 1, col, min(limit, copy.cols - col))
        return
    step = limit // copy.cols
    for row in range(0, copy.rows, step):
        yield sender, receiver, _piece(copy, row, min(step, copy.rows - row), 0, copy.cols)


def _piece(copy: Copy, row: int, rows: int, col: int, cols: int) -> Copy:
    return Copy(
        copy.hf,
        rows,
        cols,
        copy.source,
        copy.source_offset + row * copy.source_stride + col,
        copy.source_stride,
        copy.target,
        copy.target_offset + row * copy.target_stride + col,
        copy.target_stride,
    )


def _buckets(items: Iterator[tuple[int, int, Copy]], limit: int) -> tuple[tuple[Message, ...], ...]:
    """Copies in order into buckets where no rank sends or receives more than ``limit``
    elements, each bucket's copies grouped into one message per (sender, receiver)."""
    buckets: list[dict[tuple[int, int], list[Copy]]] = [{}]
    sends: dict[int, int] = defaultdict(int)
    receives: dict[int, int] = defaultdict(int)
    for sender, receiver, copy in items:
        if buckets[-1] and (
            sends[sender] + copy.numel > limit or receives[receiver] + copy.numel > limit
        ):
            buckets.append({})
            sends.clear()
            receives.clear()
        buckets[-1].setdefault((sender, receiver), []).append(copy)
        sends[sender] += copy.numel
        receives[receiver] += copy.numel
    return tuple(
        tuple(Message(s, r, tuple(c)) for (s, r), c in sorted(bucket.items()))
        for bucket in buckets
        if bucket
    )


def _digest(content: object) -> str:
    """SHA-256 of ``content`` (dataclasses, tuples, ints, strings) in a canonical JSON form."""

    def plain(value: object) -> object:
        if isinstance(value, Message):
            return [value.sender, value.receiver, value.copies]  # copies: named tuples
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        return value

    text = json.dumps(plain(content), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
