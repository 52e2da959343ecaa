"""Routing replay in one process: the routers use exactly the given experts, missing routes are
routed live, bad routes are refused, a near-tie case (an "engine" whose router weights are
rounded to bfloat16, the actor in float32) shows a router disagreement and a log-prob gap that
replay removes, and a train step that recomputes its activations under replay equals the one
that keeps them. (The layouts are checked against one process in test_moe_train_layouts.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402

from bapo_megatron.actor.actor import build_actor  # noqa: E402
from bapo_megatron.actor.batch import PolicyBatch  # noqa: E402
from bapo_megatron.actor.logprobs import (  # noqa: E402
    compute_logprobs,
    compute_logprobs_and_routes,
)
from bapo_megatron.actor.microbatches import Batching  # noqa: E402
from bapo_megatron.actor.routing_replay import validate_routes  # noqa: E402
from bapo_megatron.actor.train_step import train_step  # noqa: E402
from bapo_megatron.algo.search_plan import SearchPlan  # noqa: E402
from bapo_megatron.config import (  # noqa: E402
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
)
from bapo_megatron.config.moe import MoeConfig  # noqa: E402

EXPERTS, TOPK = 8, 2
MODEL = ModelConfig(
    model_type="qwen3_moe",
    num_layers=3,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=32,
    moe=MoeConfig(
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=16,
        mlp_only_layers=(0,),
        router_aux_loss_coef=0.01,
    ),
)
ACTOR = ActorConfig(micro_batch_size=2, seed=7)
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=1.0)


def batch(n: int = 4, length: int = 12) -> PolicyBatch:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, MODEL.vocab_size, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, 4:10] = True
    mask[-1, 7:] = False  # a shorter one
    return PolicyBatch(tokens=tokens, response_mask=mask)


def logprobs(actor, data: PolicyBatch) -> torch.Tensor:
    return compute_logprobs(
        actor.chunks,
        data,
        actor.context,
        batching=Batching(ACTOR.micro_batch_size),
        temperature=1.0,
        routing=actor.routing_replay,
    )[0]


def routed_experts(actor, data: PolicyBatch) -> torch.Tensor:
    """[n, s, moe_layers, experts] bool: which experts the routers chose, captured from their
    outputs (routing maps) in a forward pass with ``data``'s routes replayed."""
    maps = []

    def capture(router, args, output):
        maps.append(output[1].detach().clone())  # [s * b, E], sequence-major

    handles = [
        m.register_forward_hook(capture)
        for c in actor.chunks
        for m in c.modules()
        if isinstance(m, TopKRouter)
    ]
    try:
        logprobs(actor, data)
    finally:
        for handle in handles:
            handle.remove()
    b = ACTOR.micro_batch_size
    s = data.tokens.shape[1]
    layers = len(handles)
    # forward order: micro-batch 0 (layers 0..L-1), micro-batch 1, ...
    per_mb = [maps[i : i + layers] for i in range(0, len(maps), layers)]
    out = torch.cat(
        [torch.stack([m.view(s, b, EXPERTS).transpose(0, 1) for m in mb], dim=2) for mb in per_mb]
    )
    return out[: data.num_sequences]


def as_sets(routes: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*routes.shape[:-1], EXPERTS, dtype=torch.bool).scatter_(-1, routes, True)


def random_routes(n: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    layers = MODEL.moe.num_moe_layers(MODEL.num_layers)
    scores = torch.rand(n, s, layers, EXPERTS, generator=g)
    return scores.topk(TOPK, dim=-1).indices  # distinct ids per row


@pytest.fixture
def actor(single_process):
    return build_actor(MODEL, ACTOR, OPTIMIZER, single_process)


def test_replay_uses_exactly_the_given_experts(actor):
    data = batch()
    routes = random_routes(*data.tokens.shape, seed=1)
    got = routed_experts(actor, dataclasses.replace(data, routes=routes))
    assert torch.equal(got, as_sets(routes))
    live = routed_experts(actor, data)
    assert not torch.equal(live, got)  # random routes are not the live ones


def test_recorded_routes_replayed_reproduce_the_logprobs_exactly(actor):
    data = batch()
    plain = logprobs(actor, data)
    recorded_lp, routes = compute_logprobs_and_routes(
        actor.chunks,
        data,
        actor.context,
        actor.routing_replay,
        batching=Batching(2),
        temperature=1.0,
    )
    assert routes.shape == (*data.tokens.shape, 2, TOPK)
    assert torch.equal(recorded_lp, plain)
    assert torch.equal(as_sets(routes), routed_experts(actor, data))
    assert torch.equal(logprobs(actor, dataclasses.replace(data, routes=routes)), plain)
    shifted = (routes + 1) % EXPERTS
    assert not torch.allclose(logprobs(actor, dataclasses.replace(data, routes=shifted)), plain)


def test_missing_routes_are_routed_live(actor):
    data = batch()
    live = routed_experts(actor, data)
    routes = random_routes(*data.tokens.shape, seed=2)
    missing = torch.zeros(data.tokens.shape, dtype=torch.bool)
    missing[:, -1] = True  # the last sampled token: the engine never ran it
    missing[1, :5] = True  # prompt tokens the engine gave no routes for
    routes[missing] = -1
    got = routed_experts(actor, dataclasses.replace(data, routes=routes))
    assert torch.equal(got[missing], live[missing])
    assert torch.equal(got[~missing], as_sets(routes.clamp(min=0))[~missing])
    all_missing = torch.full_like(routes, -1)
    assert torch.equal(
        logprobs(actor, dataclasses.replace(data, routes=all_missing)), logprobs(actor, data)
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r: r.__setitem__((1, 3, 0, 0), EXPERTS),
            "sequence 1, token 3, MoE layer 0: expert",
        ),
        (lambda r: r.__setitem__((2, 5, 1, 0), -3), "sequence 2, token 5, MoE layer 1: expert id"),
        (
            lambda r: r.__setitem__((0, 2, 1), torch.tensor([4, 4])),
            "sequence 0, token 2, MoE layer 1: the same expert twice",
        ),
        (
            lambda r: r.__setitem__((3, 0, 0, 1), -1),
            "sequence 3, token 0, MoE layer 0: a route mixes expert ids and -1",
        ),
    ],
)
def test_bad_routes_are_refused_naming_sequence_token_and_layer(edit, message):
    routes = random_routes(4, 12, seed=3)
    edit(routes)
    with pytest.raises(ValueError, match=message):
        validate_routes(routes, MODEL, "batch.routes")


def test_routes_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match=r"expected \[sequences, tokens, 2 MoE layers, top-2\]"):
        validate_routes(torch.zeros(4, 12, 3, 2, dtype=torch.long), MODEL)
    with pytest.raises(ValueError, match="batch.routes: expected a"):
        PolicyBatch(
            tokens=torch.zeros(2, 5, dtype=torch.long),
            response_mask=torch.zeros(2, 5, dtype=torch.bool),
            routes=torch.zeros(2, 4, 2, 2, dtype=torch.long),
        )


def test_a_train_step_refuses_bad_routes(actor):
    data = batch()
    routes = random_routes(*data.tokens.shape, seed=4)
    routes[0, 1, 0] = torch.tensor([5, 5])
    data = dataclasses.replace(
        data,
        routes=routes,
        old_logprobs=torch.zeros(data.tokens.shape),
        advantages=torch.ones(data.num_sequences),
    )
    with pytest.raises(ValueError, match="batch.routes: sequence 0, token 1, MoE layer 0"):
        train_step(actor, data, LossConfig(), fixed_plan())


def fixed_plan() -> SearchPlan:
    return SearchPlan.from_config(ClipSearchConfig.from_preset("paper", granularity="step"))


def test_near_tie_engine_in_bfloat16_disagrees_and_replay_removes_it(actor):
    """The "engine" is the actor with its router weights rounded to bfloat16 (what a bf16
    engine computes the router with). The routers of experts 0-3 are made nearly equal
    (relative differences of 1e-3, below bfloat16's 4e-3 rounding), so the top-2 among them
    are near ties, which that rounding flips."""
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for chunk in actor.chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    w = module.weight
                    w[:4] = w[0] * (1 + 1e-3 * torch.randn(4, w.shape[1], generator=g))
                    w[4:] *= 0.1  # experts 4-7 rarely chosen
    engine = build_actor(MODEL, ACTOR, OPTIMIZER, actor.context)
    with torch.no_grad():
        for mine, theirs in zip(actor.chunks, engine.chunks):
            for (name, p), (_, q) in zip(
                mine.module.named_parameters(), theirs.module.named_parameters()
            ):
                q.copy_(p.to(torch.bfloat16).float() if "router" in name else p)
    data = batch(n=8, length=16)
    engine_lp, engine_routes = compute_logprobs_and_routes(
        engine.chunks,
        data,
        engine.context,
        engine.routing_replay,
        batching=Batching(2),
        temperature=1.0,
    )
    response = data.response_mask

    def disagreement(routed: torch.Tensor) -> float:
        differs = (routed != as_sets(engine_routes)).any(-1).any(-1)  # per token, any layer
        return float(differs[response].float().mean())

    def gap(lp: torch.Tensor) -> float:
        return float((lp - engine_lp)[response].abs().max())

    live = routed_experts(actor, data)
    replayed_data = dataclasses.replace(data, routes=engine_routes)
    replayed = routed_experts(actor, replayed_data)
    assert disagreement(live) > 0  # the near tie flips some routes
    assert disagreement(replayed) == 0
    assert gap(logprobs(actor, replayed_data)) < 0.1 * gap(logprobs(actor, data))


def test_recompute_under_replay_equals_the_recorded_forward(single_process):
    """Recomputed routers must route as the first forward did: with routes that are not the
    live ones, a wrong recompute would give other gradients."""
    data = batch()
    routes = random_routes(*data.tokens.shape, seed=5)
    routes[:, -1] = -1
    g = torch.Generator().manual_seed(12)
    train_data = dataclasses.replace(
        data,
        routes=routes,
        old_logprobs=torch.where(
            data.response_mask, -4.0 + 0.1 * torch.randn(4, 12, generator=g), 0
        ),
        advantages=torch.randn(4, generator=g),
    )
    runs = {}
    for recompute in (False, True):
        actor = build_actor(
            MODEL,
            dataclasses.replace(ACTOR, recompute_activations=recompute),
            OPTIMIZER,
            single_process,
        )
        metrics = [train_step(actor, train_data, LossConfig(), fixed_plan()) for _ in range(2)]
        params = {n: p.detach().clone() for n, p in actor.named_parameters().items()}
        runs[recompute] = (metrics, params)
    (kept, kept_params), (recomputed, recomputed_params) = runs[False], runs[True]
    for a, b in zip(kept, recomputed):
        for key in ("loss", "grad_norm", "entropy", "moe/aux_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    for name, value in kept_params.items():
        torch.testing.assert_close(recomputed_params[name], value, rtol=1e-6, atol=1e-7)
    # and replay mattered: live routing trains differently
    live = build_actor(MODEL, ACTOR, OPTIMIZER, single_process)
    live_metrics = train_step(
        live, dataclasses.replace(train_data, routes=None), LossConfig(), fixed_plan()
    )
    assert live_metrics["grad_norm"] != pytest.approx(kept[0]["grad_norm"], rel=1e-4)
