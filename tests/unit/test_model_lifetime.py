"""What Megatron-Core keeps of a model after it is dropped (bapo_megatron/megatron_patches/
model_lifetime.py): a built chunk's router replays are not in Megatron's class-level list, its
rotary embedding caches in a cache of its own, its MoE dispatchers keep no autograd graph after
a forward, and a dropped chunk is freed."""

from __future__ import annotations

import gc
import weakref

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from bapo_megatron.actor.model import build_model
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.config.moe import MoeConfig

MODEL = ModelConfig(
    model_type="qwen3_moe",
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=32,
    moe=MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,)
    ),
)


def forward_with_grad(chunk: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 12), generator=g)
    positions = torch.arange(12).expand(2, -1)
    return chunk(tokens, positions, attention_mask=None)


def test_the_chunks_router_replays_are_not_in_megatrons_list(single_process):
    [chunk] = build_model(MODEL, ParallelConfig(), single_process)
    replays = [m.router_replay for m in chunk.modules() if isinstance(m, TopKRouter)]
    assert replays and all(replay is not None for replay in replays)
    listed = {id(replay) for replay in RouterReplay.global_router_replay_instances}
    assert not listed & {id(replay) for replay in replays}


def test_the_rotary_embedding_caches_in_a_cache_of_its_own(single_process):
    [chunk] = build_model(MODEL, ParallelConfig(), single_process)
    rotary = chunk.rotary_pos_emb
    assert "forward" in vars(rotary) and hasattr(rotary.forward, "cache_info")
    on_the_class = RotaryEmbedding.forward.cache_info().currsize
    with torch.no_grad():
        forward_with_grad(chunk)
    assert rotary.forward.cache_info().currsize == 1
    assert RotaryEmbedding.forward.cache_info().currsize == on_the_class


def test_moe_dispatchers_keep_no_autograd_graph_after_a_forward(single_process):
    [chunk] = build_model(MODEL, ParallelConfig(), single_process)
    logits = forward_with_grad(chunk)
    assert logits.grad_fn is not None
    layers = [m for m in chunk.modules() if isinstance(m, BaseMoELayer)]
    assert layers
    for layer in layers:
        kept = [
            name
            for name, value in vars(layer.token_dispatcher).items()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None
        ]
        assert kept == [], kept


def test_a_dropped_chunk_is_freed_with_its_rotary_embedding_and_router_replays(single_process):
    [chunk] = build_model(MODEL, ParallelConfig(), single_process)
    forward_with_grad(chunk).sum().backward()
    parts = [chunk, chunk.rotary_pos_emb]
    parts += [m.router_replay for m in chunk.modules() if isinstance(m, TopKRouter)]
    freed = [weakref.ref(part) for part in parts]
    del chunk, parts
    gc.collect()
    assert [ref() for ref in freed] == [None] * len(freed)
