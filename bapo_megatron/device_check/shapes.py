"""The models and batches the device check trains: named sizes, each with a CPU-sized variant so
that the same command runs in CI (the shared starting point, an HF folder of one of them, is
:mod:`bapo_megatron.device_check.start_folder`)."""

from __future__ import annotations

import math

import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.config import ModelConfig
from bapo_megatron.config.moe import MoeConfig

# Qwen2.5-0.5B's published shapes (24 layers, hidden 896, 14 heads in 2 query groups, MLP 4864,
# q/k/v bias, tied embeddings, vocabulary 151936): 494M parameters.
QWEN25_05B = dict(
    model_type="qwen2",
    num_layers=24,
    hidden_size=896,
    ffn_hidden_size=4864,
    num_attention_heads=14,
    num_query_groups=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    max_position_embeddings=2048,
)
# The tiny CPU run's model (examples/tiny_cpu/train.yaml) with a vocabulary the random batches use.
TINY = dict(
    model_type="llama",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    max_position_embeddings=512,
)
# What `small` shrinks to where only a CPU is at hand (CI): same family, 2 layers.
SMALL_ON_CPU = dict(
    QWEN25_05B,
    num_layers=2,
    hidden_size=128,
    ffn_hidden_size=256,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=1024,
)

# Qwen3-8B's published layer shapes (hidden 4096, 32 heads of 128 in 8 query groups, MLP 12288,
# q/k norms, untied, vocabulary 151936) with 4 of its 36 layers: the memory calibration's model.
QWEN3_8B_4_LAYERS = dict(
    model_type="qwen3",
    num_layers=4,
    hidden_size=4096,
    ffn_hidden_size=12288,
    num_attention_heads=32,
    num_query_groups=8,
    head_dim=128,
    vocab_size=151936,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
)

# A tiny Qwen3-MoE: 2 layers, the second with 4 experts of which each token takes 2.
TINY_MOE = dict(
    model_type="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    moe=MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=(0,)
    ),
)

# Qwen3-30B-A3B's published layer shapes (hidden 2048, 32 heads of 128 in 4 query groups, every
# layer 128 experts of width 768, top-8, untied, vocabulary 151936) with 2 of its 48 layers:
# 1.87B parameters, the MoE memory calibration's model (experts all on the one GPU).
QWEN3_30B_A3B_2_LAYERS = dict(
    model_type="qwen3_moe",
    num_layers=2,
    hidden_size=2048,
    ffn_hidden_size=6144,
    num_attention_heads=32,
    num_query_groups=4,
    head_dim=128,
    vocab_size=151936,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
    moe=MoeConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
)
# What it shrinks to on a CPU: the same routing (top-8 of 128) on small matrices.
MOE_ON_CPU = dict(
    QWEN3_30B_A3B_2_LAYERS,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    vocab_size=1024,
    moe=MoeConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32),
)

SIZES = {
    "tiny": TINY,
    "tiny-moe": TINY_MOE,
    "small": QWEN25_05B,
    "qwen3-8b-4l": QWEN3_8B_4_LAYERS,
    "qwen3-30b-a3b-2l": QWEN3_30B_A3B_2_LAYERS,
}
"""Sizes by name; `small` is the ~0.5B model of the GPU check."""


CPU_SIZED = {"small": SMALL_ON_CPU, "qwen3-8b-4l": SMALL_ON_CPU, "qwen3-30b-a3b-2l": MOE_ON_CPU}
"""What the CPU-sized check replaces the large sizes by: 2-layer models of their family."""


def model_config(size: str, *, cpu_sized: bool, dtype: str = "float32") -> ModelConfig:
    """The model of ``size``; ``cpu_sized`` replaces the large ones (:data:`CPU_SIZED`) by a
    2-layer model of the same family."""
    fields = CPU_SIZED[size] if (cpu_sized and size in CPU_SIZED) else SIZES[size]
    return ModelConfig(**fields, params_dtype=dtype)


def random_batch(
    vocab_size: int, *, sequences: int, length: int, seed: int, spread: float = 0.3
) -> PolicyBatch:
    """Off-policy training data: random tokens, responses after a prompt of 1/4 of the length,
    old log-probs around a typical value for the vocabulary so that ratios spread around 1, and
    advantages of both signs (a share of sequences negative, as in RL of reasoning models)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (sequences, length), generator=g)
    mask = torch.zeros(sequences, length, dtype=torch.bool)
    for row in range(sequences):
        start = length // 4
        end = int(torch.randint(start + length // 4, length + 1, (), generator=g))
        mask[row, start:end] = True
    old = torch.where(
        mask, -math.log(vocab_size) + spread * torch.randn(sequences, length, generator=g), 0.0
    )
    advantages = torch.randn(sequences, generator=g)
    return PolicyBatch(tokens=tokens, response_mask=mask, old_logprobs=old, advantages=advantages)
