"""Megatron's data-parallel wrapper, optimizer and learning-rate schedule for the actor, and the
optimizer step that skips updates whose gradient norm is not finite.

Gradients: the loss of every micro-batch is already divided by the step's global normalizer
(:func:`bapo_megatron.algo.policy_loss.aggregate`), so Megatron is told the loss is "per token"
(``calculate_per_token_loss``): the schedules neither divide it by the micro-batch count nor
does DDP average over data-parallel ranks; gradients are summed, which is the global mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import clip_grads, distrib_optimizer, get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from bapo_megatron.config import OptimizerConfig
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.device import uses_cuda
from bapo_megatron.megatron_patches.cpu_runtime import cuda_sites_on_cpu


def wrap_data_parallel(
    chunks: list[torch.nn.Module],
    config: TransformerConfig,
    optimizer: OptimizerConfig,
    context: ParallelContext,
) -> list[DistributedDataParallel]:
    """Wrap each model chunk in Megatron's DDP (fp32 gradient buffers, reduced after the last
    micro-batch) and hook the gradient finalization into ``config`` for the schedules."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optimizer.use_distributed_optimizer,
    )
    # Before DDP reads it: sum gradients over data-parallel ranks instead of averaging.
    config.calculate_per_token_loss = True
    wrapped = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # Only the first chunk gets buckets sized for overlap; the rest
            # are reduced together at the end (Megatron's own convention).
            disable_bucketing=index > 0,
            pg_collection=context.process_groups,
        )
        for index, chunk in enumerate(chunks)
    ]

    def finalize(model, num_tokens, pg_collection=None, force_all_reduce=False):
        # The schedules pass the summed token count for per-token losses; ours are normalized
        # already, so it must not scale the gradients again.
        finalize_model_grads(
            model, None, pg_collection=context.process_groups, force_all_reduce=force_all_reduce
        )

    config.finalize_model_grads_func = finalize
    no_sync = [chunk.no_sync for chunk in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return wrapped


def build_optimizer(
    chunks: list[DistributedDataParallel],
    optimizer: OptimizerConfig,
    params_dtype: torch.dtype,
    context: ParallelContext,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Megatron's Adam over the DDP-wrapped chunks and its learning-rate/weight-decay schedule;
    ``optimizer.cpu_offload_fraction`` > 0 makes it Megatron's hybrid host/GPU optimizer."""
    require_offload_support(optimizer, context.config.device)
    fraction = optimizer.cpu_offload_fraction
    megatron_config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.adam_beta1,
        adam_beta2=optimizer.adam_beta2,
        adam_eps=optimizer.adam_eps,
        clip_grad=optimizer.clip_grad,
        bf16=params_dtype is torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=optimizer.use_distributed_optimizer,
        optimizer_cpu_offload=fraction > 0,
        optimizer_offload_fraction=fraction,
        overlap_cpu_optimizer_d2h_h2d=optimizer.overlap_cpu_offload,
    )
    with cuda_sites_on_cpu():
        # The separate gloo groups Megatron would create for the distributed optimizer's
        # checkpoints cannot be combined with explicit groups; the default groups serve.
        megatron_optimizer = get_megatron_optimizer(
            megatron_config,
            chunks,
            use_gloo_process_groups=False,
            pg_collection=context.process_groups,
        )
    _fused_adam_on_cpu(megatron_optimizer)
    decays = optimizer.lr_decay_steps is not None
    scheduler = OptimizerParamScheduler(
        megatron_optimizer,
        init_lr=0.0 if optimizer.lr_warmup_steps else optimizer.lr,
        max_lr=optimizer.lr,
        min_lr=optimizer.min_lr,
        lr_warmup_steps=optimizer.lr_warmup_steps,
        # Megatron's scheduler needs a decay horizon past the warmup even when constant.
        lr_decay_steps=optimizer.lr_decay_steps if decays else optimizer.lr_warmup_steps + 1,
        lr_decay_style=optimizer.lr_decay_style if decays else "constant",
        start_wd=optimizer.weight_decay,
        end_wd=optimizer.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return megatron_optimizer, scheduler


def _fused_adam_on_cpu(optimizer: MegatronOptimizer) -> None:
    """Give torch's Adam its fused kernel where every parameter it steps lives on the CPU.

    Without Transformer Engine or Apex, Megatron-Core builds ``torch.optim.AdamW``, which off the
    GPU defaults to neither ``foreach`` nor ``fused``: it then updates one tensor at a time in
    about ten elementwise passes. The fused CPU kernel makes one vectorized pass, 6.5x faster on
    2 cores for a 135M-parameter model (0.54 s -> 0.08 s a step), with the same update up to
    rounding."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.AdamW):
            continue
        for group in adam.param_groups:
            params = group["params"]
            if params and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
                group["foreach"], group["fused"] = False, True


def require_offload_support(optimizer: OptimizerConfig, device: str) -> None:
    """Refuse optimizer CPU offload where Megatron-Core 0.16.1 cannot carry it through a run:
    on a run whose ``parallel.device`` (``device``) is not CUDA (its ``HybridDeviceOptimizer``
    moves tensors with CUDA streams and pinned memory and tells GPU from host tensors by
    ``is_cuda``), and without Transformer Engine or Apex, where the distributed optimizer's
    ``state_dict`` asserts on the fresh offloading optimizer's empty state, so that its
    checkpoints save but never load (found on an H200 without TE, docs/validation.md run 6):
    a crashed run could not resume."""
    fraction = optimizer.cpu_offload_fraction
    if fraction > 0 and not uses_cuda(device):
        raise ValueError(
            f"optimizer.cpu_offload_fraction={fraction} needs a CUDA run "
            f"(parallel.device {device!r} resolves to the CPU): Megatron's optimizer offload "
            "(HybridDeviceOptimizer) is CUDA-only; set optimizer.cpu_offload_fraction=0"
        )
    if fraction > 0 and not distrib_optimizer.HAVE_APEX_OR_TE:
        raise ValueError(
            f"optimizer.cpu_offload_fraction={fraction} needs Transformer Engine or Apex: "
            "without them megatron-core 0.16.1 cannot load the offloading optimizer's "
            "checkpoints, so the run could not resume; install one, or set "
            "optimizer.cpu_offload_fraction=0"
        )


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did."""

    grad_norm: float
    """Global gradient norm before clipping (inf or nan when the step was skipped for it)."""
    skipped: bool
    """The update was not applied because the gradient norm was not finite."""
    lr: float
    """Learning rate the step used."""


def optimizer_step(
    optimizer: MegatronOptimizer, scheduler: OptimizerParamScheduler, clip_grad: float
) -> StepOutcome:
    """Apply the accumulated gradients: compute the global norm (over every model-parallel
    rank), skip the update when it is inf/nan, otherwise clip to ``clip_grad`` (0: no clipping)
    and step; the schedule advances only on applied steps. Every rank reaches the same decision,
    since the norm is reduced before it is tested."""
    lr = _current_lr(optimizer)
    with cuda_sites_on_cpu():
        found_inf = optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            optimizer.zero_grad()
            return StepOutcome(
                grad_norm=grad_norm if not found_inf else math.inf, skipped=True, lr=lr
            )
        if clip_grad > 0:
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                params = inner.get_parameters()
                if params:
                    clip_grads.clip_grad_by_total_norm_fp32(
                        params, max_norm=clip_grad, total_norm=grad_norm
                    )
        optimizer.step_with_ready_grads()
    scheduler.step(increment=1)
    return StepOutcome(grad_norm=grad_norm, skipped=False, lr=lr)


def _current_lr(optimizer: MegatronOptimizer) -> float:
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else 0.0
