"""The few collectives the trainer calls itself, each a no-op in a one-process run.

:func:`raise_if_any_rank_failed` is the one way ranks agree on a failure: a rank that fails
alone and raises would leave every other rank waiting for it in the next collective (for
torch's process-group timeout), so every place where one rank may fail while others go on calls
it first, and then all ranks raise the same error, naming each rank that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def _world(group: dist.ProcessGroup | None) -> int:
    if group is not None:  # a group joined beside the default one, or without any
        return group.size()
    return dist.get_world_size() if dist.is_initialized() else 1


def describe_failure(failure: BaseException) -> str:
    """``Type: message``, as a failure is reported to the other ranks."""
    return f"{type(failure).__name__}: {failure}"


def raise_if_any_rank_failed(
    failure: BaseException | None,
    *,
    where: str,
    error_type: Callable[[str], Exception] = RuntimeError,
    describe: Callable[[BaseException], str] = describe_failure,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Collective over ``group`` (default: the world): every rank passes its ``failure`` (None if
    it has none); if any rank has one, every rank raises ``error_type("{where}: rank R: ...")``
    naming each failed rank (group ranks), chained to this rank's own failure. One small
    all-gather; nothing in a one-process run."""
    message = None if failure is None else describe(failure)
    messages = [message]
    size = _world(group)
    if size > 1:
        messages = [None] * size
        dist.all_gather_object(messages, message, group=group)
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if failed:
        report = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise error_type(f"{where}: {report}") from failure


def on_every_rank(
    action: Callable[[], T],
    *,
    where: str,
    catch: type[BaseException] = Exception,
    error_type: Callable[[str], Exception] = RuntimeError,
    describe: Callable[[BaseException], str] = describe_failure,
    group: dist.ProcessGroup | None = None,
) -> T:
    """Run ``action`` on this rank and return its result; if it raised ``catch`` here or on any
    other rank of ``group``, raise on every rank as :func:`raise_if_any_rank_failed` does."""
    failure, result = None, None
    try:
        result = action()
    except catch as error:
        failure = error
    raise_if_any_rank_failed(
        failure, where=where, error_type=error_type, describe=describe, group=group
    )
    return result


def sum_over(
    values: list[float], group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
) -> list[float]:
    """Element-wise sums of ``values`` over ``group``, in float64 (every rank gets them)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if _world(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def max_over(
    values: list[float], group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
) -> list[float]:
    """Element-wise maxima of ``values`` over ``group``, in float64 (every rank gets them)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if _world(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def union_over(names: list[str], group: dist.ProcessGroup | None) -> list[str]:
    """The sorted union of every rank's ``names`` over ``group`` (one small all-gather;
    nothing in a one-process run): what ranks must agree on before reducing values that only
    some of them have."""
    gathered = [names]
    if _world(group) > 1:
        gathered = [None] * _world(group)
        dist.all_gather_object(gathered, list(names), group=group)
    return sorted({name for rank_names in gathered for name in rank_names})


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (nothing in a one-process run)."""
    if _world(group) > 1:
        dist.barrier(group=group)
