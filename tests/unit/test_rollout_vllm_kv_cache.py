"""The in-process vLLM's context and CPU KV cache, sized for the rollout batch
(bapo_megatron/rollout/vllm/kv_cache_size.py). Pure arithmetic: no vLLM needed."""

from __future__ import annotations

import dataclasses
import math

from bapo_megatron.config import ModelConfig, RolloutConfig
from bapo_megatron.rollout.vllm.kv_cache_size import (
    CPU_BLOCK_TOKENS,
    GIB,
    MARGIN,
    UNKNOWN_LENGTH_CAP_GIB,
    engine_context,
    kv_bytes_per_token,
)

# SmolLM2-135M-Instruct's shape: 30 layers, 9 heads of 64, 3 key/value heads, 8192 positions.
SMOLLM2 = ModelConfig(
    model_type="llama",
    num_layers=30,
    hidden_size=576,
    ffn_hidden_size=1536,
    num_attention_heads=9,
    num_query_groups=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
BATCH = RolloutConfig(engine="vllm", prompts_per_step=8, samples_per_prompt=4, max_new_tokens=64)


def test_a_token_takes_every_layers_keys_and_values():
    # 2 (key, value) x 30 layers x 3 heads x 64 channels x 4 bytes; vLLM 0.32 agrees: its 1 GiB
    # cache for this model held 23,296 tokens (182 blocks of 128, 2**30 // (128 * 46080))
    assert kv_bytes_per_token(SMOLLM2, "float32", 1) == 46080
    assert (GIB // (CPU_BLOCK_TOKENS * 46080)) * CPU_BLOCK_TOKENS == 23296
    assert kv_bytes_per_token(SMOLLM2, "bfloat16", 1) == 23040
    # the heads are split over the workers; fewer heads than workers are replicated
    assert kv_bytes_per_token(SMOLLM2, "float32", 3) == 46080 // 3
    assert kv_bytes_per_token(SMOLLM2, "float32", 4) == 46080 // 3


def test_the_cache_holds_the_batch_when_the_longest_prompt_is_known():
    sized = engine_context(BATCH, SMOLLM2, dtype="float32", longest_prompt_tokens=40)
    assert sized.max_model_len == 40 + 64
    # 32 sequences of 104 tokens, one block of 128 each, and the margin: 40 blocks, 225 MiB
    blocks = math.ceil(32 * MARGIN)
    assert sized.kv_cache_gib * GIB == blocks * CPU_BLOCK_TOKENS * 46080
    longer = engine_context(BATCH, SMOLLM2, dtype="float32", longest_prompt_tokens=200)
    assert longer.max_model_len == 264
    assert longer.kv_cache_gib * GIB == math.ceil(32 * 3 * MARGIN) * CPU_BLOCK_TOKENS * 46080


def test_the_context_never_exceeds_the_models_positions():
    short = dataclasses.replace(SMOLLM2, max_position_embeddings=96)
    sized = engine_context(BATCH, short, dtype="float32", longest_prompt_tokens=40)
    assert sized.max_model_len == 96


def test_an_unknown_prompt_length_keeps_the_former_size_at_most():
    sized = engine_context(BATCH, SMOLLM2, dtype="float32")
    assert sized.max_model_len == 8192
    # 32 full-context sequences would take 11 GiB; the cap keeps what the adapter always used
    assert sized.kv_cache_gib == UNKNOWN_LENGTH_CAP_GIB
    # a context bounded by the run (train.max_position_embeddings) sizes the cache for the batch
    bounded = dataclasses.replace(SMOLLM2, max_position_embeddings=128)
    assert engine_context(BATCH, bounded, dtype="float32").kv_cache_gib < 0.25


def test_the_cache_always_holds_one_sequence_of_the_whole_context():
    # vLLM refuses to start with less than one max_model_len sequence (plus its null block)
    long_context = dataclasses.replace(SMOLLM2, max_position_embeddings=131072)
    one = RolloutConfig(engine="vllm", prompts_per_step=1, samples_per_prompt=1)
    sized = engine_context(one, long_context, dtype="float32")
    assert sized.kv_cache_gib * GIB == (131072 // CPU_BLOCK_TOKENS + 1) * CPU_BLOCK_TOKENS * 46080
    assert sized.kv_cache_gib > UNKNOWN_LENGTH_CAP_GIB
