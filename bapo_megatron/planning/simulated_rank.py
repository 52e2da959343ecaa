"""One process plays one rank of a large layout: a fake ``torch.distributed`` world of the
layout's size (torch's ``fake`` backend: collectives return at once, no other process exists),
Megatron's parallel state for that rank, and the rank's model shard built on the meta device
(shapes and attributes only, no memory). As torchtitan's memory estimation does, a whole world is
checked by playing its ranks in turn."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import layers

# Importing the module registers the "fake" backend with torch.distributed.
from torch.testing._internal.distributed.fake_pg import FakeStore

from bapo_megatron.actor.model import build_model
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.distributed.context import ParallelContext

META = torch.device("meta")


@contextmanager
def simulated_rank(
    parallel: ParallelConfig, world_size: int, rank: int
) -> Iterator[ParallelContext]:
    """The :class:`ParallelContext` of ``rank`` in a fake world of ``world_size`` ranks laid out
    as ``parallel``, with the meta device as its device; torn down on exit. Megatron's extra gloo
    groups are not made (the fake backend cannot make gloo groups; the planner needs none)."""
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_rank: torch.distributed is already initialized in this process; the "
            "planner needs a process of its own"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        context = ParallelContext.initialize(parallel, gloo_groups=False)
        try:
            yield dataclasses.replace(context, device=META)
        finally:
            context.teardown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_meta_shard(
    model: ModelConfig, parallel: ParallelConfig, context: ParallelContext
) -> list[torch.nn.Module]:
    """The rank's model chunks exactly as the trainer builds them
    (:func:`~bapo_megatron.actor.model.build_model`), with every tensor on the meta device."""
    with torch.device(META), meta_weights_skip_the_full_matrix():
        return build_model(model, parallel, context, initialize=False)


@contextmanager
def meta_weights_skip_the_full_matrix() -> Iterator[None]:
    """Megatron's CPU initialization of a tensor-parallel weight (``use_cpu_initialization``:
    build the full matrix, initialize it, keep this rank's slices), reduced to what it leaves on
    a meta weight: its tensor-parallel attributes. The full matrix, its split and ``torch.cat`` of
    the slices compute nothing on the meta device, yet they were a third of the planner's time
    for the 235B recipe's 64 ranks. Weights on another device take Megatron's own function."""
    megatrons = layers._initialize_affine_weight_cpu
    signature = inspect.signature(megatrons)  # once: a large plan makes ~30,000 calls

    def initialize(weight, output_size, input_size, *args, **kwargs):
        if weight.device.type != "meta":
            return megatrons(weight, output_size, input_size, *args, **kwargs)
        bound = signature.bind(weight, output_size, input_size, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if not given["skip_set_tensor_parallel_attributes"]:
            layers.set_tensor_model_parallel_attributes(
                tensor=weight, is_parallel=True, dim=given["partition_dim"], stride=given["stride"]
            )
        if given["return_master_weight"]:
            return torch.empty(output_size, input_size, dtype=given["params_dtype"], device=META)
        return None

    layers._initialize_affine_weight_cpu = initialize
    try:
        yield
    finally:
        layers._initialize_affine_weight_cpu = megatrons


def megatron_rank(parallel: ParallelConfig, world_size: int, tp: int, dp: int, pp: int) -> int:
    """Global rank of the given tensor, data and pipeline coordinates (context-parallel rank 0)
    in Megatron's default order ``tp-cp-ep-dp-pp`` (tensor-parallel ranks adjacent)."""
    tp_size, cp_size = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    dp_size = world_size // parallel.model_parallel_size
    return tp + tp_size * cp_size * (dp + dp_size * pp)


def expert_rank(
    parallel: ParallelConfig, world_size: int, etp: int, ep: int, edp: int, pp: int
) -> int:
    """Global rank of the given expert tensor, expert model, expert data and pipeline
    coordinates in Megatron's expert order ``tp-ep-dp-pp`` (its second decomposition of a
    stage's ranks, tensor parallel read as expert tensor parallel)."""
    etp_size, ep_size = parallel.expert_tensor_parallel_size, parallel.expert_model_parallel_size
    edp_size = world_size // (parallel.pipeline_model_parallel_size * etp_size * ep_size)
    return etp + etp_size * (ep + ep_size * (edp + edp_size * pp))


def expert_coordinates(
    parallel: ParallelConfig, world_size: int, rank: int
) -> tuple[int, int, int]:
    """``(etp_rank, ep_rank, edp_rank)`` of global ``rank`` (inverse of :func:`expert_rank`)."""
    etp_size, ep_size = parallel.expert_tensor_parallel_size, parallel.expert_model_parallel_size
    edp_size = world_size // (parallel.pipeline_model_parallel_size * etp_size * ep_size)
    local = rank % (etp_size * ep_size * edp_size)
    return local % etp_size, local // etp_size % ep_size, local // (etp_size * ep_size)
