"""Whether a parallel layout fits a model, a world size and the machine: layout validation and
the accelerator probe it consults. Called before any process group or model is built, so that a
layout that cannot work fails with the fields to change."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from bapo_megatron.config import ModelConfig, ParallelConfig, RolloutConfig
from bapo_megatron.distributed.device import uses_cuda


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """What the machine offers that some layouts need; probed by :meth:`detect`, or given
    explicitly (tests, dry runs on another machine)."""

    transformer_engine: bool
    """Transformer Engine is importable."""
    cuda: bool
    """A CUDA GPU is visible to torch."""
    fp8_gpu: bool
    """The GPU computes in FP8 (compute capability 8.9 or newer: Ada, Hopper, Blackwell)."""

    @classmethod
    def detect(cls, device: str = "auto") -> Accelerator:
        """Probe the current process (does not import Transformer Engine) for a run whose
        ``parallel.device`` is ``device``: a GPU the run does not use counts as none."""
        te = importlib.util.find_spec("transformer_engine") is not None
        cuda = uses_cuda(device)
        fp8 = cuda and torch.cuda.get_device_capability() >= (8, 9)
        return cls(transformer_engine=te, cuda=cuda, fp8_gpu=fp8)


def validate_layout(
    model: ModelConfig,
    parallel: ParallelConfig,
    world_size: int,
    accelerator: Accelerator | None = None,
) -> int:
    """Check that ``parallel`` can split ``model`` over ``world_size`` ranks on this machine
    (``accelerator``: probed when None) and return the data-parallel size. Raises ``ValueError``
    naming the fields on the first problem."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp, vpp = parallel.context_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if world_size % parallel.model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel = "
            f"{tp} x {pp} x {cp} = {parallel.model_parallel_size} "
            "(parallel.tensor_model_parallel_size, pipeline_model_parallel_size, "
            "context_parallel_size)"
        )
    tp_divided = (
        ("num_attention_heads", ""),
        ("num_query_groups", "; every rank needs whole key/value heads"),
        ("ffn_hidden_size", ""),
        ("vocab_size", "; vocabulary padding is not implemented"),
    )
    for name, why in tp_divided:
        value = getattr(model, name)
        if value % tp:
            raise ValueError(
                f"model.{name} ({value}) is not divisible by "
                f"parallel.tensor_model_parallel_size ({tp}){why}"
            )
    _validate_experts(model, parallel, world_size)
    chunks = pp * (vpp or 1)
    if model.num_layers % chunks:
        what = f"pipeline x virtual pipeline = {pp} x {vpp}" if vpp else f"pipeline = {pp}"
        raise ValueError(
            f"model.num_layers ({model.num_layers}) is not divisible by {what} "
            "(parallel.pipeline_model_parallel_size, virtual_pipeline_model_parallel_size)"
        )
    if accelerator is None:
        accelerator = Accelerator.detect(parallel.device)
    if cp > 1 and not (accelerator.transformer_engine and accelerator.cuda):
        raise ValueError(
            f"parallel.context_parallel_size={cp} needs Transformer Engine on a CUDA GPU "
            f"(found transformer_engine={accelerator.transformer_engine}, "
            f"cuda={accelerator.cuda}); "
            "set it to 1"
        )
    if parallel.fp8 is not None:
        if not accelerator.transformer_engine:
            raise ValueError(
                f"parallel.fp8={parallel.fp8!r} needs Transformer Engine, which is not installed; "
                "set parallel.fp8=null"
            )
        if not accelerator.fp8_gpu:
            raise ValueError(
                f"parallel.fp8={parallel.fp8!r} needs a GPU with FP8 support (compute capability "
                f">= 8.9), found {'a GPU without it' if accelerator.cuda else 'no GPU'}; "
                "set parallel.fp8=null"
            )
    return world_size // parallel.model_parallel_size


def _validate_experts(model: ModelConfig, parallel: ParallelConfig, world_size: int) -> None:
    """The expert-parallel checks of :func:`validate_layout`. Megatron decomposes the ranks of a
    pipeline stage twice: tensor x context x data parallel for attention and dense layers, and
    expert tensor x expert model x expert data parallel for the experts; both products are
    world / pipeline."""
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
    if not model.is_moe:
        for name, value in (
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
        ):
            if value > 1:
                raise ValueError(
                    f"parallel.{name}={value} needs a mixture-of-experts model; "
                    f"model.model_type {model.model_type!r} is dense (set it to 1)"
                )
        return
    moe = model.moe
    if moe.num_experts % ep:
        raise ValueError(
            f"model.moe.num_experts ({moe.num_experts}) is not divisible by "
            f"parallel.expert_model_parallel_size ({ep}); every rank holds as many experts"
        )
    if moe.moe_intermediate_size % etp:
        raise ValueError(
            f"model.moe.moe_intermediate_size ({moe.moe_intermediate_size}) is not divisible by "
            f"parallel.expert_tensor_parallel_size ({etp})"
        )
    stage_ranks = world_size // parallel.pipeline_model_parallel_size
    if stage_ranks % (ep * etp):
        raise ValueError(
            f"the {stage_ranks} ranks of a pipeline stage (world size {world_size} / "
            f"pipeline {parallel.pipeline_model_parallel_size}) are not divisible by expert "
            f"tensor x expert model parallel = {etp} x {ep} "
            "(parallel.expert_tensor_parallel_size, expert_model_parallel_size)"
        )
    if parallel.tensor_model_parallel_size > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"parallel.tensor_model_parallel_size={parallel.tensor_model_parallel_size} with a "
            "mixture-of-experts model needs parallel.sequence_parallel=true (Megatron's MoE "
            "layer refuses tensor parallelism without it)"
        )


@dataclass(frozen=True, kw_only=True)
class WorldSplit:
    """How a disaggregated run divides the torchrun world: the first ``trainer_size`` ranks
    train (tensor x pipeline x context x data parallel, as a colocated run over that many
    ranks), the last ``engine_count`` ranks run one engine replica each."""

    world_size: int
    engine_count: int
    data_parallel_size: int
    """Data-parallel replicas of the trainer; engine replica ``i`` serves replica ``i``."""

    @property
    def trainer_size(self) -> int:
        """Ranks that train (global ranks 0 .. trainer_size - 1)."""
        return self.world_size - self.engine_count

    def is_engine(self, rank: int) -> bool:
        """Whether global rank ``rank`` runs an engine replica."""
        return rank >= self.trainer_size

    def engine_index(self, rank: int) -> int:
        """Which engine replica global rank ``rank`` runs."""
        if not self.is_engine(rank):
            raise ValueError(f"rank {rank} is a trainer rank, not an engine rank")
        return rank - self.trainer_size

    def engine_rank(self, index: int) -> int:
        """The global rank of engine replica ``index``."""
        return self.trainer_size + index


def split_world(parallel: ParallelConfig, rollout: RolloutConfig, world_size: int) -> WorldSplit:
    """The trainer/engine split of a disaggregated run over ``world_size`` ranks; ``ValueError``
    naming the settings when it does not divide (checked on every rank before any process
    group is joined, so trainer and engine ranks refuse alike)."""
    engines = rollout.engine_ranks
    if rollout.placement != "disaggregated":
        raise ValueError(
            f"rollout.placement={rollout.placement!r}: only a disaggregated run splits its world"
        )
    if world_size <= engines:
        raise ValueError(
            f"the world has {world_size} ranks and rollout.engine_ranks={engines} of them run "
            "engines, which leaves no trainer rank (start more processes or lower "
            "rollout.engine_ranks)"
        )
    trainers = world_size - engines
    mp = parallel.model_parallel_size
    if trainers % mp:
        raise ValueError(
            f"world size {world_size} minus rollout.engine_ranks={engines} leaves {trainers} "
            f"trainer ranks, not divisible by tensor x pipeline x context parallel = {mp} "
            "(parallel.tensor_model_parallel_size, pipeline_model_parallel_size, "
            "context_parallel_size)"
        )
    dp = trainers // mp
    if engines != dp:
        raise ValueError(
            f"rollout.engine_ranks={engines} must equal the trainer's data-parallel size {dp} "
            f"({trainers} trainer ranks / model parallel {mp}): each data-parallel replica "
            "sends its prompts to one engine replica of its own"
        )
    if rollout.prompts_per_step % dp:
        raise ValueError(
            f"rollout.prompts_per_step ({rollout.prompts_per_step}) must be a multiple of "
            f"the trainer's data-parallel size ({dp})"
        )
    return WorldSplit(world_size=world_size, engine_count=engines, data_parallel_size=dp)
