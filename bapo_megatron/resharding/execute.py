"""Run a shard-to-shard plan: every rank of the transfer group calls :func:`execute_plan` with its
part, senders with the local tensors the plan's copies read, receivers with the checkpoint-format
tensors the copies write.

Before any byte moves, the ranks compare the plan's digest and the dtype of their tensors (one
small all-gather) and agree on every rank's local check (the tensors the plan names exist, are
contiguous, hold the plan's element size and contain every run): a failure anywhere raises the
same :class:`ReshardError` on every rank, naming each rank that failed. Then the receivers zero
the plan's fills and the buckets run in order, one batched point-to-point call each
(:mod:`.transport`).
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.resharding.plan import Message, ReshardPlan
from bapo_megatron.resharding.transport import copy_view, exchange_bucket

WHERE = "shard-to-shard transfer"


class ReshardError(RuntimeError):
    """A transfer that cannot run or did not finish: the same message on every rank."""


@dataclass(frozen=True)
class TransferCounts:
    """What one rank moved in one run of a plan (copies to itself excluded)."""

    sent_bytes: int
    received_bytes: int
    sent_messages: int
    received_messages: int
    buckets: int
    """Buckets in which this rank sent or received anything."""


def execute_plan(
    plan: ReshardPlan,
    group: dist.ProcessGroup,
    *,
    timeout: datetime.timedelta,
    sources: Mapping[str, torch.Tensor] | None = None,
    targets: Mapping[str, torch.Tensor] | None = None,
) -> TransferCounts:
    """Run ``plan`` as this process's rank of ``group`` (the ranks the plan names). ``sources``:
    the local tensors this rank sends from; ``targets``: those it receives into. A rank may be
    both or neither; every rank of ``group`` must call. ``timeout`` bounds each point-to-point
    wait (the collectives are bounded by the group's own timeout): pass the group's. Under
    NCCL the tensors are CUDA tensors on the rank's current device."""
    sources, targets = dict(sources or {}), dict(targets or {})
    rank = dist.get_rank(group)
    failure, like = None, None
    try:
        like = _check_local(plan, rank, sources, targets)
    except ValueError as error:
        failure = error
    # The digest all-gather is also the group's first collective of the transfer, which NCCL
    # requires before batched point-to-point calls that involve only some of its ranks.
    mine = (plan.digest, None if like is None else str(like.dtype))
    agreed = [mine] * dist.get_world_size(group)
    dist.all_gather_object(agreed, mine, group=group)
    failure = _disagreement(agreed, rank) or failure
    raise_if_any_rank_failed(failure, where=WHERE, error_type=ReshardError, group=group)

    for receiver, fills in plan.fills:
        if receiver == rank:
            for fill in fills:
                flat = targets[fill.local].view(-1)
                copy_view(flat, fill.offset, fill.rows, fill.cols, fill.row_stride).zero_()
    totals = Counter()
    for index, bucket in enumerate(plan.buckets):
        if not any(rank in (m.sender, m.receiver) for m in bucket):
            continue
        try:
            traffic = exchange_bucket(bucket, rank, sources, targets, like, group, timeout)
        except (RuntimeError, TimeoutError) as error:
            raise ReshardError(
                f"{WHERE}: rank {rank}: bucket {index + 1} of {len(plan.buckets)} failed: {error}"
            ) from error
        totals.update(vars(traffic))
        totals["buckets"] += 1
    return TransferCounts(
        sent_bytes=totals["sent_bytes"],
        received_bytes=totals["received_bytes"],
        sent_messages=totals["sent_messages"],
        received_messages=totals["received_messages"],
        buckets=totals["buckets"],
    )


def _disagreement(agreed: list[tuple[str, str | None]], rank: int) -> ValueError | None:
    """This rank's failure when its digest differs from the one most ranks hold (ties: the
    lowest rank's), or its dtype from the first rank's that has tensors."""
    digests = Counter(digest for digest, _ in agreed)
    common = max(digests, key=lambda digest: digests[digest])
    digest, dtype = agreed[rank]
    if digest != common:
        held = [r for r, (d, _) in enumerate(agreed) if d == common]
        return ValueError(
            f"plan digest {digest[:16]} differs from {common[:16]}, the digest of ranks {held}: "
            "the ranks planned from different shard maps or bucket sizes"
        )
    dtypes = [(r, d) for r, (_, d) in enumerate(agreed) if d is not None]
    if dtype is not None and dtype != dtypes[0][1]:
        return ValueError(f"tensors of dtype {dtype}, rank {dtypes[0][0]}'s are {dtypes[0][1]}")
    return None


def _check_local(
    plan: ReshardPlan,
    rank: int,
    sources: dict[str, torch.Tensor],
    targets: dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """``ValueError`` naming the tensor unless this rank's tensors fit its part of the plan;
    returns one of them (whose dtype and device the buffers take), None when it has no part."""
    reads: dict[str, int] = {}
    writes: dict[str, int] = {}
    for message in _messages_of(plan, rank):
        for copy in message.copies:
            last = (copy.rows - 1) * copy.source_stride + copy.cols + copy.source_offset
            if message.sender == rank:
                reads[copy.source] = max(reads.get(copy.source, 0), last)
            last = (copy.rows - 1) * copy.target_stride + copy.cols + copy.target_offset
            if message.receiver == rank:
                writes[copy.target] = max(writes.get(copy.target, 0), last)
    for receiver, fills in plan.fills:
        if receiver == rank:
            for fill in fills:
                last = (fill.rows - 1) * fill.row_stride + fill.cols + fill.offset
                writes[fill.local] = max(writes.get(fill.local, 0), last)
    used = [
        _checked(tensors, name, end, role, plan.element_bytes)
        for role, tensors, ends in (("source", sources, reads), ("target", targets, writes))
        for name, end in sorted(ends.items())
    ]
    kinds = {(tensor.dtype, tensor.device) for tensor in used}
    if len(kinds) > 1:
        raise ValueError(f"the plan's tensors must share one dtype and device, got {kinds}")
    return used[0] if used else None


def _messages_of(plan: ReshardPlan, rank: int) -> Iterable[Message]:
    for bucket in plan.buckets:
        for message in bucket:
            if rank in (message.sender, message.receiver):
                yield message


def _checked(
    tensors: dict[str, torch.Tensor], name: str, end: int, role: str, element_bytes: int
) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"no {role} tensor {name!r} (the plan's copies use it)")
    if not tensor.is_contiguous():
        raise ValueError(f"{role} tensor {name!r} is not contiguous")
    if tensor.element_size() != element_bytes:
        raise ValueError(
            f"{role} tensor {name!r} has {tensor.element_size()}-byte elements, the plan "
            f"{element_bytes}"
        )
    if tensor.numel() < end:
        raise ValueError(
            f"{role} tensor {name!r} has {tensor.numel()} elements, the plan reaches element {end}"
        )
    return tensor
