"""The seam through which the loss reaches other ranks: a ``reduce`` callable that sums a tensor
over the data x context parallel group. One process passes :func:`identity_reduce`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

ReduceFn = Callable[[torch.Tensor], torch.Tensor]


def identity_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over a group of one."""
    return x


def all_reduce_sum(group: dist.ProcessGroup | None = None) -> ReduceFn:
    """A ``reduce`` that sums over ``group`` (the default group when None) with one all-reduce."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return reduce
