"""Bytes of one rank's actor state: parameters, gradient buffers and optimizer state, computed
from the rank's (meta) model chunks with the rules Megatron-Core 0.16 allocates by.

- Parameters: every parameter of the rank's chunks at its dtype (the tied output layer of a
  last pipeline stage is a parameter of its own there).
- Gradients: the trainer's DDP (:func:`bapo_megatron.actor.optimizer.wrap_data_parallel`) keeps
  one fp32 gradient buffer per chunk and dtype (``grad_reduce_in_fp32``) and, without overlapped
  reduction, one bucket per buffer. With the distributed optimizer Megatron pads every
  parameter's start to 64 elements and every bucket's end to lcm(data-parallel size, 128), and
  puts the tied embedding in a bucket of its own (``_ParamAndGradBuffer``); without it there is
  no padding. :func:`grad_buffer_layout` repeats that layout.
- Optimizer: Adam's two fp32 moments per optimized element, and an fp32 main copy of each
  element of a parameter stored in lower precision (Megatron's mixed precision). The distributed
  optimizer optimizes only the elements of the rank's 1/dp shard of each bucket (padding
  excluded). Adam's per-tensor step counters (a scalar each) are not counted.
- Experts (mixture of experts with expert parallelism): DDP puts the parameters Megatron marks
  ``allreduce=False`` (the experts, when EP > 1) in buffers of their own, reduced and, with the
  distributed optimizer, sharded over the expert data-parallel group instead of the data-parallel
  one, with the same padding rules at that group's size. :func:`actor_state_bytes` takes one
  part at a time (``part``), so that a rank's dense and expert state can be computed at their
  own group's size and rank and added.
- Offload (``optimizer.cpu_offload_fraction``): Megatron's ``HybridDeviceOptimizer`` moves whole
  optimized tensors, in order, to the host until the fraction of the part's elements is reached,
  and runs their Adam update there. The distributed optimizer keeps its fp32 main shard of them
  on the GPU (it copies the host result back into it), so the GPU saves only their two moments;
  the host holds the moments, a pinned fp32 copy of the main shard and a pinned fp32 gradient
  copy. :func:`offload_optimizer` counts the fraction's share of elements, rounded up (the
  whole tensors it really moves may add a little more).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch

GRAD_BYTES = 4  # fp32 gradient buffers (grad_reduce_in_fp32)
ADAM_MOMENT_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MAIN_PARAM_BYTES = 4  # fp32 main copy of a bf16 parameter
# Per offloaded element on the host: the moments, the main shard's copy and the gradient's copy.
HOST_OPTIMIZER_BYTES = ADAM_MOMENT_BYTES + MAIN_PARAM_BYTES + GRAD_BYTES

Part = Literal["all", "dense", "experts"]


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """Whether Megatron's DDP puts ``param`` in the expert-parallel buffers (its own rule)."""
    return not getattr(param, "allreduce", True)


@dataclass(frozen=True)
class GradBuffer:
    """Where each parameter lies in one DDP buffer, and the buffer's buckets."""

    numel: int
    """Elements of the buffer, padding included."""
    param_ranges: tuple[tuple[int, int], ...]
    """(start, end) of each parameter, in the buffer's (reversed parameter) order."""
    buckets: tuple[tuple[int, int], ...]
    """(start, end) of each bucket."""


def grad_buffer_layout(
    params: Sequence[torch.nn.Parameter], dp_size: int, distributed_optimizer: bool
) -> GradBuffer:
    """The layout Megatron's ``_ParamAndGradBuffer`` gives ``params`` (one dtype, in
    ``named_parameters`` order) with no bucket size limit (``overlap_grad_reduce=False``)."""

    def pad(value: int, divisor: int) -> int:
        return -(-value // divisor) * divisor if distributed_optimizer else value

    bucket_divisor = math.lcm(dp_size, 128)
    ranges: list[tuple[int, int]] = []
    buckets: list[tuple[int, int]] = []
    bucket_start, start, open_bucket = 0, 0, False
    for param in reversed(params):
        start = pad(start, 64)
        alone = distributed_optimizer and getattr(param, "shared_embedding", False)
        if alone and open_bucket:
            start = pad(start, bucket_divisor)
            buckets.append((bucket_start, start))
            bucket_start = start
        end = start + param.numel()
        ranges.append((start, end))
        open_bucket = True
        if alone:
            start = pad(end, bucket_divisor)
            buckets.append((bucket_start, start))
            bucket_start, open_bucket = start, False
        else:
            start = end
    if open_bucket:
        end = pad(start, bucket_divisor)
        buckets.append((bucket_start, end))
        start = end
    return GradBuffer(numel=start, param_ranges=tuple(ranges), buckets=tuple(buckets))


def shard_elements(buffer: GradBuffer, dp_size: int, dp_rank: int) -> int:
    """Parameter elements (padding excluded) in data-parallel rank ``dp_rank``'s shard of
    ``buffer``: the ``dp_rank``-th 1/dp of every bucket."""
    total = 0
    for bucket_start, bucket_end in buffer.buckets:
        size = (bucket_end - bucket_start) // dp_size
        lo = bucket_start + dp_rank * size
        hi = lo + size
        total += sum(max(0, min(hi, end) - max(lo, start)) for start, end in buffer.param_ranges)
    return total


@dataclass(frozen=True)
class ActorStateBytes:
    """One rank's actor state, in bytes."""

    parameters: int
    """Parameter elements (not bytes)."""
    weights: int
    gradients: int
    optimizer: int
    """On the GPU, with the recipe's ``use_distributed_optimizer`` (and offload, once
    :func:`offload_optimizer` applied it)."""
    optimizer_replicated: int
    """Without the distributed optimizer (every rank holds the full state of its shard), without
    offload."""
    optimizer_distributed: int
    """With the distributed optimizer, without offload."""
    optimized: int = 0
    """Elements the recipe's optimizer updates on this rank."""
    optimizer_host: int = 0
    """Host memory of the offloaded share (:func:`offload_optimizer`)."""

    @property
    def total(self) -> int:
        """Weights, gradients and (the recipe's) optimizer state."""
        return self.weights + self.gradients + self.optimizer

    def __add__(self, other: ActorStateBytes) -> ActorStateBytes:
        """Both parts of one rank's state (dense and experts) together."""
        return ActorStateBytes(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


def actor_state_bytes(
    chunks: Sequence[torch.nn.Module],
    dp_size: int,
    dp_rank: int,
    distributed_optimizer: bool,
    part: Part = "all",
) -> ActorStateBytes:
    """:class:`ActorStateBytes` of a rank holding ``chunks`` (built, on any device, unwrapped
    or DDP-wrapped) at data-parallel rank ``dp_rank`` of ``dp_size``: of all its parameters
    (one buffer group, as DDP has without expert parallelism), or of the ``dense`` ones or the
    ``experts`` (:func:`is_expert_parallel`) alone, whose ``dp_size`` / ``dp_rank`` are then the
    expert data-parallel group's."""
    weights = parameters = 0
    grads = {True: 0, False: 0}
    optimizer = {True: 0, False: 0}
    optimized = {True: 0, False: 0}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for param in module.parameters():
            if part != "all" and is_expert_parallel(param) != (part == "experts"):
                continue
            weights += param.numel() * param.element_size()
            parameters += param.numel()
            if param.requires_grad:
                by_dtype.setdefault(param.dtype, []).append(param)
        for dtype, params in by_dtype.items():
            # fp32 parameters (a float32 model) are their own main copy; lower-precision ones
            # get an fp32 one.
            per_element = ADAM_MOMENT_BYTES + (MAIN_PARAM_BYTES if dtype != torch.float32 else 0)
            for distributed in (True, False):
                buffer = grad_buffer_layout(params, dp_size, distributed)
                grads[distributed] += buffer.numel * GRAD_BYTES
                elements = (
                    shard_elements(buffer, dp_size, dp_rank)
                    if distributed
                    else sum(p.numel() for p in params)
                )
                optimizer[distributed] += elements * per_element
                optimized[distributed] += elements
    return ActorStateBytes(
        parameters=parameters,
        weights=weights,
        gradients=grads[distributed_optimizer],
        optimizer=optimizer[distributed_optimizer],
        optimizer_replicated=optimizer[False],
        optimizer_distributed=optimizer[True],
        optimized=optimized[distributed_optimizer],
    )


def offload_optimizer(state: ActorStateBytes, fraction: float) -> ActorStateBytes:
    """``state`` (one part: dense or experts, each offloaded by an optimizer of its own) with
    ``fraction`` of its optimized elements offloaded: their moments leave the GPU's
    ``optimizer``, :data:`HOST_OPTIMIZER_BYTES` each go to ``optimizer_host``."""
    moved = math.ceil(state.optimized * fraction)
    return dataclasses.replace(
        state,
        optimizer=state.optimizer - moved * ADAM_MOMENT_BYTES,
        optimizer_host=moved * HOST_OPTIMIZER_BYTES,
    )
