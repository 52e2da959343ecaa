"""Run a shard-to-shard plan: every rank of the transfer group calls :func:`execute_plan` with its
part, senders with the local tensors the plan's copies read, receivers with the tensors the
copies write (a mapping, or :class:`TargetTensors` that open each tensor when its first bucket
comes and hear when its last one has been written).

Before any byte moves, the ranks compare the plan's digest and their wire dtype (one small
all-gather) and agree on every rank's local check (the tensors the plan names exist, are
contiguous and contain every run): a failure anywhere raises the same :class:`ReshardError` on
every rank, naming each rank that failed. Then the buckets run in order, one batched
point-to-point call each (:mod:`.transport`); a receiver zeroes a tensor's fills when it opens it.

Only the :class:`~torch.distributed.ProcessGroup`'s own rank and size are used, so the group
may be one that engine workers joined from processes of another world.
"""

from __future__ import annotations

import datetime
import pickle
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.resharding.plan import Message, ReshardPlan
from bapo_megatron.resharding.transport import BufferKind, copy_view, exchange_bucket

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


class TargetTensors(Protocol):
    """A receiver's tensors, opened when the plan first writes them."""

    device: torch.device

    def numel(self, name: str) -> int | None:
        """Elements of tensor ``name``; None when there is no such tensor."""

    def open(self, name: str) -> torch.Tensor:
        """The contiguous tensor ``name`` to write into."""

    def written(self, names: list[str]) -> None:
        """Every element of ``names`` has been written."""

    def abort(self) -> None:
        """The transfer failed: put back what can be put back."""


class ResidentTargets:
    """:class:`TargetTensors` over tensors that already exist."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        first = next(iter(self.tensors.values()), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def numel(self, name: str) -> int | None:
        tensor = self.tensors.get(name)
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"target tensor {name!r} is not contiguous")
        return None if tensor is None else tensor.numel()

    def open(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def written(self, names: list[str]) -> None:
        pass

    def abort(self) -> None:
        pass


def execute_plan(
    plan: ReshardPlan,
    group: dist.ProcessGroup,
    *,
    timeout: datetime.timedelta,
    sources: Mapping[str, torch.Tensor] | None = None,
    targets: Mapping[str, torch.Tensor] | TargetTensors | None = None,
    wire_dtype: torch.dtype | None = None,
) -> TransferCounts:
    """Run ``plan`` as this process's rank of ``group`` (the ranks the plan names). ``sources``:
    the local tensors this rank sends from; ``targets``: those it receives into. A rank may be
    both or neither; every rank of ``group`` must call. ``wire_dtype``: the dtype elements
    travel in (converted from the sources' and into the targets' own); default: this rank's
    tensors' dtype, which every rank must then share. ``timeout`` bounds each point-to-point
    wait (the collectives are bounded by the group's own timeout): pass the group's. Under
    NCCL the tensors are CUDA tensors on the rank's current device."""
    sources = dict(sources or {})
    if targets is None or isinstance(targets, Mapping):
        targets = ResidentTargets(targets or {})
    rank = group.rank()
    failure, kind = None, None
    try:
        kind = _check_local(plan, rank, sources, targets, wire_dtype)
    except ValueError as error:
        failure = error
    # The digest all-gather is also the group's first collective of the transfer, which NCCL
    # requires before batched point-to-point calls that involve only some of its ranks.
    mine = (plan.digest, None if kind is None else str(kind.dtype))
    agreed = [mine] * group.size()
    dist.all_gather_object(agreed, mine, group=group)
    failure = _disagreement(agreed, rank) or failure
    raise_if_any_rank_failed(failure, where=WHERE, error_type=ReshardError, group=group)

    opened = _Opened(plan, rank, targets)
    totals = Counter()
    for index, bucket in enumerate(plan.buckets):
        if not any(rank in (m.sender, m.receiver) for m in bucket):
            continue
        try:
            traffic = exchange_bucket(
                bucket, rank, sources, opened.for_bucket(index), kind, group, timeout
            )
        except (RuntimeError, TimeoutError) as error:
            raise ReshardError(
                f"{WHERE}: rank {rank}: bucket {index + 1} of {len(plan.buckets)} failed: {error}"
            ) from error
        opened.done(index)
        totals.update(vars(traffic))
        totals["buckets"] += 1
    opened.finish()
    return TransferCounts(
        sent_bytes=totals["sent_bytes"],
        received_bytes=totals["received_bytes"],
        sent_messages=totals["sent_messages"],
        received_messages=totals["received_messages"],
        buckets=totals["buckets"],
    )


class _Opened:
    """A receiver's targets opened bucket by bucket: each when its first bucket comes (its fills
    zeroed then), each reported written after its last."""

    def __init__(self, plan: ReshardPlan, rank: int, targets: TargetTensors) -> None:
        self.targets = targets
        self.tensors: dict[str, torch.Tensor] = {}
        self.first: dict[int, list[str]] = defaultdict(list)
        self.last: dict[int, list[str]] = defaultdict(list)
        self.fills = defaultdict(list)
        seen: dict[str, tuple[int, int]] = {}
        for index, bucket in enumerate(plan.buckets):
            for message in bucket:
                if message.receiver == rank:
                    for copy in message.copies:
                        first, _ = seen.get(copy.target, (index, index))
                        seen[copy.target] = (first, index)
        for receiver, fills in plan.fills:
            if receiver == rank:
                for fill in fills:
                    self.fills[fill.local].append(fill)
                    seen.setdefault(fill.local, (len(plan.buckets), len(plan.buckets)))
        for name, (first, last) in seen.items():
            self.first[first].append(name)
            self.last[last].append(name)

    def for_bucket(self, index: int) -> dict[str, torch.Tensor]:
        for name in self.first.pop(index, ()):
            self._open(name)
        return self.tensors

    def done(self, index: int) -> None:
        names = self.last.pop(index, [])
        if names:
            self.targets.written(names)
            for name in names:
                del self.tensors[name]

    def finish(self) -> None:
        """Open and report the tensors no bucket writes (fills only)."""
        for index in sorted(self.first):
            self.for_bucket(index)
            self.done(index)

    def _open(self, name: str) -> None:
        tensor = self.targets.open(name)
        flat = tensor.view(-1)
        for fill in self.fills.pop(name, ()):
            copy_view(flat, fill.offset, fill.rows, fill.cols, fill.row_stride).zero_()
        self.tensors[name] = tensor


def _disagreement(agreed: list[tuple[str, str | None]], rank: int) -> ValueError | None:
    """This rank's failure when its digest differs from the one most ranks hold (ties: the
    lowest rank's), or its wire dtype from the first rank's that moves anything."""
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
        return ValueError(f"elements travel as {dtype}, rank {dtypes[0][0]}'s as {dtypes[0][1]}")
    return None


def _check_local(
    plan: ReshardPlan,
    rank: int,
    sources: dict[str, torch.Tensor],
    targets: TargetTensors,
    wire_dtype: torch.dtype | None,
) -> BufferKind | None:
    """``ValueError`` naming the tensor unless this rank's tensors fit its part of the plan;
    returns the dtype and device its buffers take, None when it has no part."""
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
    used = [_checked_source(sources, name, end) for name, end in sorted(reads.items())]
    for name, end in sorted(writes.items()):
        _check_target(targets, name, end)
    if not used and not writes:
        return None
    devices = {tensor.device for tensor in used} | ({targets.device} if writes else set())
    if len(devices) > 1:
        raise ValueError(f"the plan's tensors must share one device, got {devices}")
    dtype = wire_dtype
    if dtype is None:
        dtypes = {tensor.dtype for tensor in used}
        if len(dtypes) > 1:
            raise ValueError(f"the plan's tensors must share one dtype, got {dtypes}")
        dtype = used[0].dtype if used else _target_dtype(targets, next(iter(writes)))
    if torch.empty((), dtype=dtype).element_size() != plan.element_bytes:
        raise ValueError(f"elements travel as {dtype}, the plan's are {plan.element_bytes} bytes")
    return BufferKind(dtype, devices.pop())


def _target_dtype(targets: TargetTensors, name: str) -> torch.dtype:
    """The dtype of resident targets (a receiver without a wire dtype receives in its own)."""
    if not isinstance(targets, ResidentTargets):
        raise ValueError("a receiver that opens its targets on demand needs a wire dtype")
    return targets.tensors[name].dtype


def _messages_of(plan: ReshardPlan, rank: int) -> Iterable[Message]:
    for bucket in plan.buckets:
        for message in bucket:
            if rank in (message.sender, message.receiver):
                yield message


def _checked_source(tensors: dict[str, torch.Tensor], name: str, end: int) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise ValueError(f"no source tensor {name!r} (the plan's copies use it)")
    if not tensor.is_contiguous():
        raise ValueError(f"source tensor {name!r} is not contiguous")
    if tensor.numel() < end:
        raise ValueError(
            f"source tensor {name!r} has {tensor.numel()} elements, the plan reaches element {end}"
        )
    return tensor


def _check_target(targets: TargetTensors, name: str, end: int) -> None:
    numel = targets.numel(name)
    if numel is None:
        raise ValueError(f"no target tensor {name!r} (the plan's copies use it)")
    if numel < end:
        raise ValueError(
            f"target tensor {name!r} has {numel} elements, the plan reaches element {end}"
        )


def shared_plan(
    plan: ReshardPlan | None, group: dist.ProcessGroup, device: torch.device | str = "cpu"
) -> ReshardPlan:
    """The plan group rank 0 holds, on every rank of ``group`` (collective; ``device``: where
    the group's tensors live, CUDA under NCCL): for members that cannot plan themselves (engine
    workers, which never see the trainer's maps)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    payload = pickle.dumps(plan) if group.rank() == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    group.broadcast([size], options).wait()
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        if group.rank() == 0
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    group.broadcast([data], options).wait()
    if group.rank() == 0:
        return plan
    received = pickle.loads(data.cpu().numpy().tobytes())
    if not isinstance(received, ReshardPlan):
        raise ReshardError(f"{WHERE}: group rank 0 sent {type(received).__name__}, not a plan")
    return received


class ReceivingMember:
    """A member of a transfer group that does not plan (an engine's worker, an engine rank of
    its own): it keeps the plan group rank 0 last broadcast and receives its part of each
    transfer with it."""

    def __init__(self) -> None:
        self.plan: ReshardPlan | None = None

    def receive(
        self,
        group: dist.ProcessGroup,
        request: Mapping[str, Any],
        open_targets: Callable[[set[str]], TargetTensors],
        device: torch.device | str = "cpu",
    ) -> TransferCounts:
        """One transfer. ``request``: ``plan_follows`` (group rank 0 broadcasts the plan
        first), ``wire_dtype`` and ``timeout_s``; ``open_targets`` gives the tensors of the
        plan's names for this rank. A plan that is not the senders' fails on every rank at the
        digest check; the targets are aborted on any failure."""
        if request["plan_follows"]:
            self.plan = shared_plan(None, group, device)
        if self.plan is None:
            raise ReshardError(
                f"{WHERE}: group rank {group.rank()} holds no plan (the trainer sends one with "
                "the first update after it changes)"
            )
        targets = open_targets(self.plan.targets_of(group.rank()))
        try:
            return execute_plan(
                self.plan,
                group,
                timeout=datetime.timedelta(seconds=float(request["timeout_s"])),
                targets=targets,
                wire_dtype=getattr(torch, request["wire_dtype"]),
            )
        except BaseException:
            targets.abort()
            raise
