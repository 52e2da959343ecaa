"""The embedded engine runs Qwen3-MoE: the actor's weights pushed through the live export (per
expert names, into transformers' fused experts) give the actor's log-probs, and the engine
records the experts every token was routed to, which the actor replays (R3) to the same
log-probs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bapo_megatron.actor.actor import build_actor  # noqa: E402
from bapo_megatron.actor.batch import PolicyBatch  # noqa: E402
from bapo_megatron.actor.logprobs import compute_logprobs, compute_logprobs_and_routes  # noqa: E402
from bapo_megatron.actor.microbatches import Batching  # noqa: E402
from bapo_megatron.config import ActorConfig, ModelConfig, OptimizerConfig  # noqa: E402
from bapo_megatron.config.moe import MoeConfig  # noqa: E402
from bapo_megatron.models.experts import fused_expert_view  # noqa: E402
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine  # noqa: E402
from bapo_megatron.rollout.protocol import SamplingParams  # noqa: E402
from bapo_megatron.weights.export import export_weights, named_tensors_of  # noqa: E402

MODEL = ModelConfig(
    model_type="qwen3_moe",
    num_layers=3,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    vocab_size=128,
    max_position_embeddings=64,
    moe=MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(0,)
    ),
)
TEMPERATURE = 0.7


def as_batch(samples) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor]:
    """(batch with the engine's routes, engine log-probs, which positions have a route)."""
    length = max(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
    n = len(samples)
    tokens = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length, dtype=torch.bool)
    logp = torch.zeros(n, length)
    routes = torch.full((n, length, 2, 2), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        ids = s.prompt_token_ids + s.token_ids
        tokens[row, : len(ids)] = torch.tensor(ids)
        mask[row, len(s.prompt_token_ids) : len(ids)] = True
        logp[row, len(s.prompt_token_ids) : len(ids)] = torch.tensor(s.logprobs)
        assert len(s.routes) == len(ids) - 1  # the last sampled token was never run
        routes[row, : len(ids) - 1] = torch.tensor(s.routes)
    routed = routes[..., 0, 0] >= 0
    return PolicyBatch(tokens=tokens, response_mask=mask, routes=routes), logp, routed


def test_engine_runs_qwen3_moe_and_records_routes_the_actor_replays(single_process):
    context = single_process
    actor = build_actor(
        MODEL, ActorConfig(temperature=TEMPERATURE, seed=9), OptimizerConfig(), context
    )
    engine = EmbeddedEngine(MODEL, record_routes=True)
    buckets = export_weights(actor.chunks, MODEL, context, version=2, bucket_bytes=32 * 1024)
    engine.update_weights(named_tensors_of(buckets), version=2)
    samples = engine.generate(
        [[5, 6, 7], [8, 9, 10, 11, 12]],
        SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=8, seed=4),
    )
    batch, engine_logp, routed = as_batch(samples)
    mask = batch.response_mask

    live_logp, actor_routes = compute_logprobs_and_routes(
        actor.chunks,
        batch,
        context,
        actor.routing_replay,
        batching=Batching(2),
        temperature=TEMPERATURE,
    )
    torch.testing.assert_close(live_logp[mask], engine_logp[mask], rtol=0, atol=2e-5)

    # the engine routed like the actor (same float32 weights; sets of experts per token)
    def as_sets(r):
        return torch.zeros(*r.shape[:-1], 4, dtype=torch.bool).scatter_(-1, r.clamp(min=0), True)

    same = (as_sets(batch.routes) == as_sets(actor_routes)).all(-1).all(-1)
    assert bool(same[routed].all())
    # R3: replaying the engine's routes gives the engine's log-probs
    replayed_logp, _ = compute_logprobs(
        actor.chunks,
        batch,
        context,
        batching=Batching(2),
        temperature=TEMPERATURE,
        routing=actor.routing_replay,
    )
    torch.testing.assert_close(replayed_logp[mask], engine_logp[mask], rtol=0, atol=2e-5)


def test_continued_samples_keep_one_route_per_run_token(single_process):
    actor = build_actor(MODEL, ActorConfig(seed=3), OptimizerConfig(), single_process)
    engine = EmbeddedEngine(MODEL, record_routes=True)
    engine.update_weights(
        named_tensors_of(export_weights(actor.chunks, MODEL, single_process, version=0)), version=0
    )
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=1)
    [sample] = engine.generate([[3, 4, 5]], params, round_tokens=2)
    assert sample.finish_reason == "paused" and len(sample.routes) == 3 + 2 - 1
    engine.continue_generation([sample], params)
    assert len(sample.routes) == 3 + len(sample.token_ids) - 1
    assert all(
        len(token) == 2 and all(len(layer) == 2 for layer in token) for token in sample.routes
    )


def test_per_expert_tensors_fill_the_fused_experts():
    params = {
        "model.layers.1.mlp.experts.gate_up_proj": torch.zeros(4, 2 * 3, 5),
        "model.layers.1.mlp.experts.down_proj": torch.zeros(4, 5, 3),
    }
    gate = fused_expert_view("model.layers.1.mlp.experts.2.gate_proj.weight", params)
    up = fused_expert_view("model.layers.1.mlp.experts.2.up_proj.weight", params)
    down = fused_expert_view("model.layers.1.mlp.experts.2.down_proj.weight", params)
    gate.fill_(1.0)
    up.fill_(2.0)
    down.fill_(3.0)
    fused = params["model.layers.1.mlp.experts.gate_up_proj"]
    assert fused[2, :3].eq(1).all() and fused[2, 3:].eq(2).all() and fused[[0, 1, 3]].eq(0).all()
    assert params["model.layers.1.mlp.experts.down_proj"][2].eq(3).all()
    assert fused_expert_view("model.layers.1.mlp.experts.4.up_proj.weight", params) is None
    assert fused_expert_view("model.layers.1.mlp.gate.weight", params) is None


def test_engine_refuses_a_wrong_expert_shape_and_routes_without_experts():
    engine = EmbeddedEngine(MODEL)
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight' has shape \(64, 31\)"):
        engine.update_weights(
            [("model.layers.1.mlp.experts.1.down_proj.weight", torch.zeros(64, 31))], version=0
        )
    dense = dataclasses.replace(MODEL, model_type="qwen3", moe=None)
    with pytest.raises(ValueError, match="record_routes: model_type 'qwen3' has no experts"):
        EmbeddedEngine(dense, record_routes=True)
