"""The layout planner's numbers against a tiny actor built and run on this machine's CPU.

- Actor state: the planner's weight, gradient and optimizer bytes
  (:func:`~bapo_megatron.planning.shard_memory.actor_state_bytes`) equal, byte for byte, those of
  an actor built by ``build_actor`` after one optimizer step: parameter tensors, the DDP
  gradient buffers, and the optimizer's fp32 main parameters plus Adam's ``exp_avg`` and
  ``exp_avg_sq`` (per-tensor step counters excluded, as the planner documents).
- Activations: measured deterministically (not RSS) as the bytes of the distinct storages autograd
  saves for backward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded) during
  one micro-batch's forward pass and log-probs, which is what the train step holds at its peak
  without pipelining (each micro-batch runs forward then backward). The planner's ``sdpa``
  estimate (the local layer spec the CPU runs) must be within 25% of it. For a mixture-of-experts
  layer (router, alltoall dispatch, experts), the same holds, and what the layer saves beyond a
  dense layer (two models that differ in that layer only) must be within 5% of the MoE estimate.
"""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.logprobs import token_logprobs
from bapo_megatron.actor.optimizer import optimizer_step
from bapo_megatron.actor.response_logits import StageLogits
from bapo_megatron.config import ActorConfig, ModelConfig, OptimizerConfig, ParallelConfig
from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.planning.activations import SWIGLU_TENSORS, ActivationShape, stage_bytes
from bapo_megatron.planning.moe_memory import moe_mlp_bytes
from bapo_megatron.planning.shard_memory import actor_state_bytes
from tests.helpers.actor_state import optimizer_state_bytes


def tiny(params_dtype: str, tied: bool = True) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        max_position_embeddings=128,
        params_dtype=params_dtype,
        tie_word_embeddings=tied,
    )


def measured_state_bytes(actor) -> tuple[int, int, int]:
    weights = sum(p.numel() * p.element_size() for c in actor.chunks for p in c.module.parameters())
    grads = sum(
        b.grad_data.numel() * b.grad_data.element_size() for c in actor.chunks for b in c.buffers
    )
    optimizer = optimizer_state_bytes(actor)
    return weights, grads, optimizer


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed-adam"])
@pytest.mark.parametrize(
    "params_dtype,tied", [("float32", True), ("bfloat16", True), ("bfloat16", False)]
)
def test_state_bytes_equal_a_built_actor(context, params_dtype, tied, distributed):
    actor = build_actor(
        tiny(params_dtype, tied),
        ActorConfig(),
        OptimizerConfig(use_distributed_optimizer=distributed),
        context,
    )
    for chunk in actor.chunks:
        for p in chunk.module.parameters():
            p.main_grad.fill_(1e-3)
    assert not optimizer_step(actor.optimizer, actor.scheduler, 1.0).skipped  # Adam state exists
    planned = actor_state_bytes(actor.chunks, 1, 0, distributed)
    assert (planned.weights, planned.gradients, planned.optimizer) == measured_state_bytes(actor)
    assert planned.optimizer > planned.weights > 0


def saved_activation_bytes(chunk, tokens: torch.Tensor, context) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + log-probs."""
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = chunk(tokens, positions, None)
        # every position's logits: the planner counts them all (the actor may compute fewer)
        logprobs, _ = token_logprobs(
            StageLogits(logits, None), tokens, context, temperature=1.0, with_entropy=False
        )
    logprobs.sum().backward()  # the saved tensors were real: backward runs through them
    return sum(seen.values())


@pytest.mark.parametrize("micro_batch_size,length", [(2, 96), (1, 128), (4, 32)])
def test_activation_estimate_within_25_percent_of_the_measured_saved_tensors(
    context, micro_batch_size, length
):
    model = ModelConfig(
        model_type="qwen2",
        num_layers=3,
        hidden_size=96,
        ffn_hidden_size=200,
        num_attention_heads=6,
        num_query_groups=2,
        vocab_size=300,
        max_position_embeddings=256,
    )
    actor = build_actor(model, ActorConfig(), OptimizerConfig(), context)
    tokens = torch.randint(
        0, model.vocab_size, (micro_batch_size, length), generator=torch.Generator().manual_seed(0)
    )
    measured = saved_activation_bytes(actor.chunks[0].module, tokens, context)
    shape = ActivationShape(
        micro_batch_size=micro_batch_size,
        sequence_length=length,
        micro_batches=1,
        attention="sdpa",
    )
    estimate = stage_bytes(model, ParallelConfig(), shape, 0, model.num_layers)
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)


def test_activation_estimates_are_linear_in_the_sequence_length():
    """Neither attention model keeps an s x s tensor (both are fused kernels)."""
    model = tiny("bfloat16")
    for attention in ("sdpa", "flash"):
        short, long = (
            stage_bytes(
                model,
                ParallelConfig(),
                ActivationShape(
                    micro_batch_size=1, sequence_length=s, micro_batches=1, attention=attention
                ),
                0,
                2,
            )
            for s in (64, 128)
        )
        assert long == 2 * short, attention


@pytest.mark.parametrize("micro_batch_size,length", [(1, 128), (4, 32)])
def test_moe_layer_estimate_matches_the_measured_saved_tensors(context, micro_batch_size, length):
    def model(mlp_only_layers: tuple[int, ...]) -> ModelConfig:
        moe = MoeConfig(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            mlp_only_layers=mlp_only_layers,
        )
        return ModelConfig(
            model_type="qwen3_moe",
            num_layers=3,
            hidden_size=96,
            ffn_hidden_size=200,
            num_attention_heads=6,
            num_query_groups=2,
            vocab_size=300,
            max_position_embeddings=256,
            moe=moe,
        )

    tokens = torch.randint(
        0, 300, (micro_batch_size, length), generator=torch.Generator().manual_seed(0)
    )
    shape = ActivationShape(
        micro_batch_size=micro_batch_size,
        sequence_length=length,
        micro_batches=1,
        attention="sdpa",
    )
    measured, estimate = {}, {}
    for name, dense_layers in (("moe", (0,)), ("dense", (0, 1))):  # layer 2 is MoE in both
        config = model(dense_layers)
        actor = build_actor(config, ActorConfig(), OptimizerConfig(), context)
        measured[name] = saved_activation_bytes(actor.chunks[0].module, tokens, context)
        estimate[name] = stage_bytes(config, ParallelConfig(), shape, 0, config.num_layers)
        assert abs(estimate[name] - measured[name]) <= 0.25 * measured[name], name
    moe_layer = moe_mlp_bytes(
        micro_batch_size * length,
        model((0,)),
        ParallelConfig(),
        4,
        SWIGLU_TENSORS["sdpa"],
    )
    extra_measured = measured["moe"] - measured["dense"]
    extra_estimate = estimate["moe"] - estimate["dense"]
    assert abs(extra_estimate - extra_measured) <= 0.05 * moe_layer, (
        extra_estimate,
        extra_measured,
    )
