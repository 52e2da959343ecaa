"""How long a sequence an in-process vLLM accepts (``max_model_len``) and how large its CPU KV
cache is, sized for the rollout batch rather than for the model's whole context.

vLLM allocates a CPU KV cache of a fixed size when it starts (``kv_cache_memory_bytes``; the
legacy ``VLLM_CPU_KVCACHE_SPACE`` counts whole GiB and wins when set) and fills it block by
block as sequences grow. A rollout call holds at most ``rollout.prompts_per_step`` x
``rollout.samples_per_prompt`` sequences, none longer than the longest prompt plus
``rollout.max_new_tokens``, so that is what the cache must hold; more only sits in memory, less
makes vLLM preempt and recompute samples (slower, not wrong). Written for vLLM 0.32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bapo_megatron.config import ModelConfig, RolloutConfig

CPU_BLOCK_TOKENS = 128
"""Tokens per KV block of vLLM 0.32 on the CPU (``platforms/cpu.py`` sets ``block_size`` 128
unless given): a sequence occupies whole blocks, so a short one still takes 128 tokens."""
MARGIN = 1.25
"""Blocks beyond the batch's: the prefix cache keeps freed blocks until they are reused, and a
partial rollout's carried samples may outnumber one step's."""
UNKNOWN_LENGTH_CAP_GIB = 1.0
"""The largest cache sized when the longest prompt is unknown: every sequence is then bounded
only by the model's context, and a batch of full-context sequences (11 GiB for SmolLM2-135M at
32 x 8192 tokens) is not what a run generates; vLLM preempts and recomputes what does not fit.
:meth:`VLLMEngine.from_pretrained <bapo_megatron.rollout.vllm.engine.VLLMEngine.from_pretrained>`
starts with this size by default."""
GIB = 2**30


@dataclass(frozen=True)
class EngineContext:
    """What an in-process vLLM is started with."""

    max_model_len: int
    """Longest prompt + response vLLM accepts."""
    kv_cache_gib: float
    """Its CPU KV cache, per worker (ignored on GPUs, where ``gpu_memory_utilization`` sizes
    it)."""


def kv_bytes_per_token(model: ModelConfig, dtype: str, tensor_parallel_size: int) -> int:
    """Bytes of key and value one token takes in one worker's cache: every layer's key/value
    heads (split over the workers; vLLM replicates them when there are fewer than workers)."""
    head_dim = model.head_dim or model.hidden_size // model.num_attention_heads
    heads = max(1, model.num_query_groups // tensor_parallel_size)
    element = 2 if dtype in ("bfloat16", "float16") else 4
    return 2 * model.num_layers * heads * head_dim * element


def engine_context(
    rollout: RolloutConfig,
    model: ModelConfig,
    *,
    dtype: str,
    tensor_parallel_size: int = 1,
    longest_prompt_tokens: int | None = None,
) -> EngineContext:
    """``max_model_len`` and the CPU KV cache for ``rollout``'s batch on ``model``.

    ``max_model_len``: the longest prompt + ``rollout.max_new_tokens`` when the longest prompt
    (``longest_prompt_tokens``, in the chat template) is known, never more than the model's
    ``max_position_embeddings`` (``train.max_position_embeddings`` when set: the run's own bound
    on prompt + response); otherwise that. The cache holds ``prompts_per_step`` x
    ``samples_per_prompt`` sequences of ``max_model_len`` tokens, each in whole blocks, times
    :data:`MARGIN`, and at least one sequence of ``max_model_len`` (vLLM refuses to start with
    less); without ``longest_prompt_tokens`` it is at most :data:`UNKNOWN_LENGTH_CAP_GIB`. The
    batch is counted over all data-parallel replicas, an upper bound for each replica's."""
    context = model.max_position_embeddings
    if longest_prompt_tokens is None:
        max_model_len = context
    else:
        max_model_len = min(context, longest_prompt_tokens + rollout.max_new_tokens)
    block_bytes = CPU_BLOCK_TOKENS * kv_bytes_per_token(model, dtype, tensor_parallel_size)
    blocks_per_sequence = math.ceil(max_model_len / CPU_BLOCK_TOKENS)
    sequences = rollout.prompts_per_step * rollout.samples_per_prompt
    batch = math.ceil(sequences * blocks_per_sequence * MARGIN) * block_bytes
    if longest_prompt_tokens is None:
        batch = min(batch, int(UNKNOWN_LENGTH_CAP_GIB * GIB))
    # one more block than one sequence needs: vLLM keeps block 0 as its null block
    smallest = (blocks_per_sequence + 1) * block_bytes
    return EngineContext(max_model_len=max_model_len, kv_cache_gib=max(batch, smallest) / GIB)
