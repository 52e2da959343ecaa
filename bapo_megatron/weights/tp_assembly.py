"""How the tensor-parallel ranks of a stage turn their shards of one export bucket into whole
HF tensors on the receiving rank(s): the transport seam of :mod:`bapo_megatron.weights.export`.

Every rank of the TP group calls :meth:`ShardTransport.assemble` with the bucket's rules; the
receiving ranks get ``{HF name: whole tensor}``, the others None. Where TP rank ``r``'s piece of
a tensor goes is the name map's :func:`~bapo_megatron.models.name_maps.place_shard` (the pieces
``split(shard)`` land at slice ``r`` of ``tp_dim``). Two transports:

- :class:`CollectiveTransport`: each rank flattens its shards into one buffer (in the export
  dtype), one ``torch.distributed`` gather (or all-gather) per bucket, and the receiver places
  every rank's pieces. NCCL on GPUs; gloo (TCP) on the CPU.
- :class:`SharedMemoryTransport` (TP ranks that are CPU processes on one host): the receiver
  allocates the bucket's output in a ``/dev/shm`` file that every TP rank maps; each rank places
  its own pieces straight into it, in parallel, so every byte is copied once. The yielded
  tensors are ordinary CPU tensors, views of that (already unlinked) file, which is freed with
  the last of them: a consumer that keeps buckets keeps them in ``/dev/shm``.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from bapo_megatron.config import ModelConfig
from bapo_megatron.distributed.collectives import on_every_rank
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.models.name_maps import ParamRule, hf_tensor_shapes, place_shard

TransportKind = Literal["auto", "collective", "shared_memory"]
SHM_DIR = Path("/dev/shm")
_PAGE = 4096


class ShardTransport(Protocol):
    """The seam: one bucket of TP shards -> whole HF tensors on the receiving ranks."""

    to_all: bool
    """Every TP rank receives (else only the first)."""
    reuse: bool
    """The yielded tensors live in a buffer that the next bucket overwrites."""

    def assemble(
        self,
        rules: Sequence[ParamRule],
        params: Mapping[str, torch.Tensor],
        model: ModelConfig,
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor] | None:
        """``{HF name: whole tensor in dtype}`` of ``rules`` on receiving ranks, None elsewhere
        (collective over the TP group)."""


class _NoSharedMemory(RuntimeError):
    """A bucket's shared-memory file could not be created or its pages reserved."""


def _is_split(rule: ParamRule, context: ParallelContext) -> bool:
    return rule.tp_dim is not None and context.tp_size > 1


class CollectiveTransport:
    """One ``torch.distributed`` gather into the first TP rank, or all-gather into all."""

    def __init__(self, context: ParallelContext, to_all: bool) -> None:
        self.context, self.to_all = context, to_all
        self.reuse = False

    def assemble(self, rules, params, model, dtype):
        ctx = self.context
        split_rules = [r for r in rules if _is_split(r, ctx)]
        device = params[rules[0].megatron].device
        pieces: list[torch.Tensor | None] | None = None
        if split_rules:
            flat = torch.empty(
                sum(params[r.megatron].numel() for r in split_rules), dtype=dtype, device=device
            )
            offset = 0
            for rule in split_rules:  # the dtype conversion happens before the transfer
                shard = params[rule.megatron]
                flat[offset : offset + shard.numel()].view(shard.shape).copy_(shard)
                offset += shard.numel()
            first = dist.get_global_rank(ctx.tp_group, 0)
            if self.to_all:
                out = torch.empty(ctx.tp_size * flat.numel(), dtype=dtype, device=device)
                dist.all_gather_single(out, flat, group=ctx.tp_group)  # torch 2.13 name
                pieces = list(out.chunk(ctx.tp_size))
            elif ctx.tp_rank == 0:
                pieces = [torch.empty_like(flat) for _ in range(ctx.tp_size)]
                dist.gather(flat, pieces, dst=first, group=ctx.tp_group)
            else:
                dist.gather(flat, None, dst=first, group=ctx.tp_group)
        if not (self.to_all or ctx.tp_rank == 0):
            return None
        out_tensors: dict[str, torch.Tensor] = {}
        offset = 0
        for rule in rules:
            shard = params[rule.megatron]
            wholes = [
                torch.empty(shape, dtype=dtype, device=device)
                for shape in hf_tensor_shapes(rule, model)
            ]
            if rule in split_rules:
                for rank, piece in enumerate(pieces):
                    local = (
                        shard
                        if rank == ctx.tp_rank
                        else piece[offset : offset + shard.numel()].view(shard.shape)
                    )
                    place_shard(rule, wholes, local, rank, model)
                offset += shard.numel()
            else:
                place_shard(rule, wholes, shard, 0, model)
            out_tensors.update(zip(rule.hf, wholes))
        return out_tensors


def _host_identity() -> str:
    """This machine (the boot id tells containers of one kernel apart from other machines)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_memory_possible(context: ParallelContext, device: torch.device) -> bool:
    """Whether every rank of the TP group is a CPU process on this host with a writable
    ``/dev/shm`` (collective over the TP group)."""
    usable = device.type == "cpu" and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)
    mine = (_host_identity(), usable)
    everyone: list = [None] * context.tp_size
    dist.all_gather_object(everyone, mine, group=context.tp_group)
    return all(ok and host == mine[0] for host, ok in everyone)


class SharedMemoryTransport:
    """TP ranks on one CPU host place their shards directly into the receiver's output, a
    ``/dev/shm`` file mapped by all of them. Per bucket: a broadcast (the file exists), an
    all-reduce (its pages are reserved) and a barrier (every piece is in place), plus a barrier
    when every rank receives (the others copy the bucket out of the shared mapping).

    The pages are reserved with ``posix_fallocate`` (each rank an equal part, in parallel), so a
    full ``/dev/shm`` (64 MiB by default in Docker) is an error up front, not a SIGBUS on a
    write. Then the bucket goes through ``fallback`` (the collective, under
    ``transport='auto'``), or ``ValueError`` on every rank.

    With ``reuse``, one mapping (grown when a bucket needs more) is kept and refilled for every
    bucket, across exports too when the same transport is passed again: its pages are warm, so
    a bucket costs a memory copy instead of page faults. The yielded tensors are then valid only
    until the next bucket is requested (a consumer that copies them, such as an engine's weight
    update or a file writer, is fine); one more barrier per bucket waits for the consumer.
    """

    def __init__(
        self,
        context: ParallelContext,
        to_all: bool,
        fallback: ShardTransport | None = None,
        reuse: bool = False,
    ) -> None:
        self.context, self.to_all, self.fallback = context, to_all, fallback
        self.reuse = reuse
        self._kept: torch.Tensor | None = None  # the reused mapping, uint8
        group = context.tp_group
        self.first = dist.get_global_rank(group, 0)
        token = [uuid.uuid4().hex if context.tp_rank == 0 else None]
        dist.broadcast_object_list(token, src=self.first, group=group)
        self.prefix = f"bapo-export-{token[0]}"
        self.buckets = 0

    def _allocate(self, path: Path, nbytes: int) -> str | None:
        """Create the bucket's file (the first rank) and reserve its pages, each rank an equal
        part, in parallel; the error (naming each rank that failed), or None (collective over
        the TP group: every rank gets the same answer)."""
        ctx = self.context

        def create() -> None:
            if ctx.tp_rank == 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                finally:
                    os.close(fd)

        def reserve() -> None:
            part = -(-nbytes // (ctx.tp_size * _PAGE)) * _PAGE
            start = ctx.tp_rank * part
            if start < nbytes:
                fd = os.open(path, os.O_RDWR)
                try:
                    os.posix_fallocate(fd, start, min(part, nbytes - start))
                finally:
                    os.close(fd)

        try:
            for step in (create, reserve):
                on_every_rank(
                    step,
                    where=str(path),
                    catch=OSError,
                    error_type=_NoSharedMemory,
                    group=ctx.tp_group,
                )
        except _NoSharedMemory as error:
            if ctx.tp_rank == 0:
                path.unlink(missing_ok=True)
            return str(error)
        return None

    def _mapping(self, nbytes: int) -> tuple[torch.Tensor | None, Path | None, str | None]:
        """(uint8 mapping of at least ``nbytes``, its file if new, error) (collective)."""
        group = self.context.tp_group
        if self.reuse and self._kept is not None and self._kept.numel() >= nbytes:
            dist.barrier(group=group)  # the consumer is done with the previous bucket
            return self._kept, None, None
        path = SHM_DIR / f"{self.prefix}-{self.buckets}"
        self.buckets += 1
        error = self._allocate(path, nbytes)
        if error is not None:
            return None, None, error
        mapping = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        if self.reuse:
            self._kept = mapping
        return mapping, path, None

    def assemble(self, rules, params, model, dtype):
        ctx = self.context
        shapes = [hf_tensor_shapes(rule, model) for rule in rules]
        total = sum(torch.Size(shape).numel() for group in shapes for shape in group)
        nbytes = total * torch.empty((), dtype=dtype).element_size()
        mapping, path, error = self._mapping(nbytes)
        if error is not None:
            if self.fallback is not None:
                return self.fallback.assemble(rules, params, model, dtype)
            raise ValueError(
                f"transport='shared_memory': the first TP rank could not allocate a "
                f"bucket in {SHM_DIR} ({error}); use transport='collective' or a "
                "smaller bucket_bytes"
            )
        receiver = ctx.tp_rank == 0
        try:
            buffer = mapping[:nbytes].view(dtype)
            out: dict[str, torch.Tensor] = {}
            offset = 0
            for rule, group in zip(rules, shapes):
                wholes = []
                for shape in group:
                    numel = torch.Size(shape).numel()
                    wholes.append(buffer[offset : offset + numel].view(shape))
                    offset += numel
                if _is_split(rule, ctx) or receiver:  # replicated tensors: the receiver's copy
                    place_shard(rule, wholes, params[rule.megatron], ctx.tp_rank, model)
                out.update(zip(rule.hf, wholes))
            dist.barrier(group=ctx.tp_group)  # every piece is in place; all have mapped the file
        finally:
            if receiver and path is not None:
                path.unlink(missing_ok=True)
        if not self.to_all:
            return out if receiver else None
        if not receiver:  # a private copy: the shared mapping stays the first rank's
            out = {name: tensor.clone() for name, tensor in out.items()}
        dist.barrier(group=ctx.tp_group)  # copied before the first rank hands its tensors out
        return out


def make_transport(
    kind: TransportKind,
    context: ParallelContext,
    device: torch.device,
    to_all: bool,
    *,
    reuse: bool = False,
) -> ShardTransport:
    """The transport of ``kind`` (collective over the TP group). `auto`: shared memory when the
    TP group is CPU processes on one host, else the collective. ``reuse``: the shared-memory
    transport refills one kept buffer (see :class:`SharedMemoryTransport`); the collective
    allocates new tensors every bucket either way."""
    if kind not in ("auto", "collective", "shared_memory"):
        raise ValueError(f"transport must be 'auto', 'collective' or 'shared_memory', got {kind!r}")
    if kind != "collective" and context.tp_size > 1:
        possible = shared_memory_possible(context, device)
        if kind == "shared_memory" and not possible:
            raise ValueError(
                "transport='shared_memory' needs every TP rank to be a CPU process "
                "on this host with a writable /dev/shm"
            )
        if possible:
            fallback = CollectiveTransport(context, to_all) if kind == "auto" else None
            return SharedMemoryTransport(context, to_all, fallback, reuse)
    return CollectiveTransport(context, to_all)
