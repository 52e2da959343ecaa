"""The actor of one rank: its model chunks wrapped for data parallelism, the optimizer and the
learning-rate schedule, built from the run configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from bapo_megatron.actor.model import build_model
from bapo_megatron.actor.moe_aux_loss import MoeAuxLoss
from bapo_megatron.actor.optimizer import build_optimizer, wrap_data_parallel
from bapo_megatron.actor.routing_replay import RoutingReplay
from bapo_megatron.config import ActorConfig, ModelConfig, OptimizerConfig
from bapo_megatron.config.parallel import fp8_length_multiple
from bapo_megatron.distributed.context import ParallelContext


@dataclass(kw_only=True)
class Actor:
    """Everything a training step touches on this rank."""

    context: ParallelContext
    model_config: ModelConfig
    actor_config: ActorConfig
    optimizer_config: OptimizerConfig
    chunks: list[DistributedDataParallel]
    """This rank's model chunks (one, or one per virtual pipeline stage), DDP-wrapped."""
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    skipped_steps: int = 0
    """Optimizer steps dropped so far because the gradient norm was not finite."""
    moe_aux_loss: MoeAuxLoss | None = None
    """The load-balancing term of a mixture-of-experts model (hooks on this rank's routers, if
    its chunks hold any); None for a dense model."""
    routing_replay: RoutingReplay | None = None
    """Replays the routes a batch carries (``PolicyBatch.routes``) in every pass of a
    mixture-of-experts model, and records routes; None for a dense model."""

    @property
    def fp8_length_multiple(self) -> int:
        """What FP8 layers need each rank's token count per micro-batch to be a multiple of (1
        without FP8)."""
        return fp8_length_multiple(self.context.config)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards by their Megatron names (``chunk<i>.`` prefixed when the
        rank holds several virtual pipeline chunks)."""
        prefix = len(self.chunks) > 1
        return {
            (f"chunk{i}." if prefix else "") + name: param
            for i, chunk in enumerate(self.chunks)
            for name, param in chunk.module.named_parameters()
        }


def build_actor(
    model: ModelConfig,
    actor: ActorConfig,
    optimizer: OptimizerConfig,
    context: ParallelContext,
    *,
    initialize: bool = True,
) -> Actor:
    """Build the model for ``context``'s layout (weights from ``actor.seed``, or left as
    allocated with ``initialize=False`` when the caller loads them all next), wrap it in
    Megatron's DDP and create the optimizer and schedule."""
    chunks = build_model(
        model,
        context.config,
        context,
        seed=actor.seed,
        initialize=initialize,
        recompute_activations=actor.recompute_activations,
    )
    config = chunks[0].config
    wrapped = wrap_data_parallel(chunks, config, optimizer, context)
    megatron_optimizer, scheduler = build_optimizer(
        wrapped, optimizer, config.params_dtype, context
    )
    return Actor(
        moe_aux_loss=MoeAuxLoss(
            chunks,
            model.moe.router_aux_loss_coef,
            context,
            recompute=actor.recompute_activations,
        )
        if model.is_moe
        else None,
        routing_replay=RoutingReplay(wrapped, model, context, recompute=actor.recompute_activations)
        if model.is_moe
        else None,
        context=context,
        model_config=model,
        actor_config=actor,
        optimizer_config=optimizer,
        chunks=wrapped,
        optimizer=megatron_optimizer,
        scheduler=scheduler,
    )
