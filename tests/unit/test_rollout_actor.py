"""The actor and the embedded engine agree: the actor's weights, pushed through the live export,
give an engine whose behaviour log-probs equal the actor's own forward-only log-probs of the same
tokens (same temperature), so the importance ratio starts at exactly 1 up to float error. For
every family: Qwen2 (q/k/v bias), Llama, Qwen3 (q/k norms, its own head size) and Llama 3.2-style
(scaled RoPE), tied and untied."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.config import ActorConfig, OptimizerConfig, ParallelConfig
from bapo_megatron.config.rope import Llama3RopeScaling
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.weights.export import export_weights, named_tensors_of
from tests.helpers.tiny_models import tiny_model

# variant -> the ModelConfig fields that make it
FAMILIES = {
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "llama-untied": dict(model_type="llama", tie_word_embeddings=False),
    "qwen3-tied": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    "qwen3-untied": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False),
    "llama32-tied": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_scaling=Llama3RopeScaling(
            factor=4.0,
            low_freq_factor=2.0,
            high_freq_factor=8.0,
            original_max_position_embeddings=60,
        ),
    ),
}


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_engine_logprobs_equal_actor_logprobs_after_export(variant):
    model = tiny_model(max_position_embeddings=64, **FAMILIES[variant])
    temperature = 0.7
    context = ParallelContext.initialize(ParallelConfig())
    try:
        actor = build_actor(
            model, ActorConfig(temperature=temperature, seed=9), OptimizerConfig(), context
        )
        engine = EmbeddedEngine(model)
        buckets = export_weights(actor.chunks, model, context, version=3, bucket_bytes=64 * 1024)
        engine.update_weights(named_tensors_of(buckets), version=3)
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
        samples = engine.generate(
            prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=8, seed=4)
        )
        length = max(len(s.prompt_token_ids) + len(s.token_ids) for s in samples)
        tokens = torch.zeros(len(samples), length, dtype=torch.long)
        mask = torch.zeros(len(samples), length, dtype=torch.bool)
        engine_logp = torch.zeros(len(samples), length)
        for row, s in enumerate(samples):
            ids = s.prompt_token_ids + s.token_ids
            tokens[row, : len(ids)] = torch.tensor(ids)
            mask[row, len(s.prompt_token_ids) : len(ids)] = True
            engine_logp[row, len(s.prompt_token_ids) : len(ids)] = torch.tensor(s.logprobs)
            assert s.versions == [3] * len(s.token_ids)
        actor_logp, _ = compute_logprobs(
            actor.chunks,
            PolicyBatch(tokens=tokens, response_mask=mask),
            context,
            batching=Batching(2),
            temperature=temperature,
        )
        torch.testing.assert_close(actor_logp[mask], engine_logp[mask], rtol=0, atol=2e-5)
    finally:
        context.teardown()
