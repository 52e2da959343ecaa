"""Activation memory of the actor's training pass: the tensors autograd saves for the backward
pass of one micro-batch, times the micro-batches a pipeline stage holds at once.

The formula counts, per decoder layer and per token of the micro-batch, the tensors the layer
saves (e = bytes of the activation dtype, h hidden, f FFN width, d head size, a / g query / KV
heads, t tensor-parallel size; "norm side" tensors are divided by t only under sequence
parallelism, the others always, since heads and FFN columns are split):

- ``sdpa`` attention (Megatron's local layer spec with the project's core attention,
  :mod:`bapo_megatron.actor.core_attention`: torch's ``scaled_dot_product_attention``; what runs
  on the CPU, and on a GPU without Transformer Engine): 6 norm-side h-wide tensors (each of the
  two torch RMSNorms keeps its input, the input times the inverse RMS, and its output for the
  next linear layer) and their two fp32 statistics, the q/k/v projection output
  ((a/t + 2g/t)·d wide; v is a view of it), rotated q and k ((a/t)·d and (g/t)·d), the attention
  output ((a/t)·d, also the output projection's input), one fp32 log-sum-exp per head, with
  Qwen3's q/k RMSNorm (``qk_layernorm``) the normalised q and k and an fp32 statistic per head,
  and 5 (f/t)-wide MLP tensors (the gate/up product, the SwiGLU pieces, the down projection's
  input); no s-long term. Counted from the saved tensors of a CPU forward pass
  (tests/unit/test_layout_planner_measured.py measures it).
- ``flash`` attention (Transformer Engine's fused attention on a GPU): 4 norm-side h-wide
  tensors (layer input, normed input, residual, normed residual), rotated q and the attention
  output ((a/t)·d each), k and v unexpanded ((g/t)·d each), 3 (f/t)-wide MLP tensors and one
  fp32 softmax statistic per head. This is a model of what Transformer Engine keeps (as in
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", and
  Megatron-LM's ``theoretical_memory_usage``), not a measurement (docs/validation.md has the
  GPU measurements of the local spec's activations against this model).

A mixture-of-experts layer (:mod:`~bapo_megatron.planning.moe_memory`) saves the same norm-side
and attention tensors, and instead of the MLP's f-wide ones its router's and experts' tensors.

Outside the layers: the first stage's embedding output, the last stage's final norm input and
output (norm side), its vocabulary-parallel logits (V/t per token, kept by the log-prob function)
and, for logits narrower than fp32, the fp32 copy the log-prob function makes while it runs.

Pipelining: with the 1F1B schedule stage p holds min(pp - p, micro-batches) micro-batches at
once; the interleaved schedule holds more, by the factor 1 + (pp - 1) / (pp · vpp) that
Megatron-LM's estimate uses.

Recomputation (``actor.recompute_activations``: Megatron's full, uniform recompute, one layer per
block): each layer of a micro-batch in flight keeps only its input (norm side, h wide), and the
backward pass recomputes one layer at a time, which then holds that layer's tensors for one
micro-batch (the larger of a dense and an MoE layer's) on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bapo_megatron.config import ActorConfig, ModelConfig, ParallelConfig
from bapo_megatron.planning.moe_memory import moe_mlp_bytes, stage_moe_layers

Attention = Literal["sdpa", "flash"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SWIGLU_TENSORS = {"sdpa": 5, "flash": 3}
"""f-wide tensors one token leaves saved in a SwiGLU MLP, per attention model (above)."""
NORM_TENSORS = {"sdpa": 6, "flash": 4}
"""Norm-side h-wide tensors one token leaves saved in a decoder layer, per attention model."""
_FP32 = 4


@dataclass(frozen=True)
class ActivationShape:
    """What one micro-batch of the training pass looks like."""

    micro_batch_size: int
    """Rows per micro-batch (sequences padded, 1 for a packed row)."""
    sequence_length: int
    """Tokens per row (padded rows: the longest sequence; a packed row: its token budget)."""
    micro_batches: int
    """Micro-batches per optimizer step on one data-parallel rank (caps the pipeline's in-flight
    count)."""
    attention: Attention = "flash"


def training_shape(actor: ActorConfig, sequence_length: int, sequences: int) -> ActivationShape:
    """The micro-batches of a training step of ``sequences`` sequences (one data-parallel rank)
    of up to ``sequence_length`` tokens, under ``actor``'s batching. The planner takes the worst
    case, every sequence at the cap: padded, ``micro_batch_size`` full rows; packed with a token
    budget, rows of the budget (a lone sequence over it: its own length)."""
    budget = actor.max_tokens_per_microbatch
    if actor.pack_sequences and budget is not None:
        per_row = max(1, budget // sequence_length)  # whole sequences fit
        return ActivationShape(
            micro_batch_size=1,
            sequence_length=max(budget, sequence_length),
            micro_batches=-(-sequences // per_row),
        )
    return ActivationShape(
        micro_batch_size=actor.micro_batch_size,
        sequence_length=sequence_length,
        micro_batches=-(-sequences // actor.micro_batch_size),
    )


def layer_bytes(model: ModelConfig, parallel: ParallelConfig, shape: ActivationShape) -> int:
    """Bytes one decoder layer saves for one micro-batch on one tensor-parallel rank."""
    t = parallel.tensor_model_parallel_size
    e = DTYPE_BYTES[model.params_dtype]
    tokens = shape.micro_batch_size * shape.sequence_length
    h, d = model.hidden_size, model.head_dim
    heads, groups = model.num_attention_heads // t, model.num_query_groups // t
    norm_tokens = tokens // t if parallel.sequence_parallel else tokens
    if shape.attention not in NORM_TENSORS:
        raise ValueError(f"attention must be 'sdpa' or 'flash', got {shape.attention!r}")
    norm_side = NORM_TENSORS[shape.attention] * norm_tokens * h * e + 2 * norm_tokens * _FP32
    if shape.attention == "sdpa":
        attention = tokens * ((3 * heads + 3 * groups) * d * e + heads * _FP32)
        if model.qk_layernorm:
            attention += tokens * (heads + groups) * (d * e + _FP32)
    else:
        attention = tokens * (2 * heads + 2 * groups) * d * e + tokens * heads * _FP32
    return norm_side + attention + dense_mlp_bytes(model, parallel, shape)


def dense_mlp_bytes(model: ModelConfig, parallel: ParallelConfig, shape: ActivationShape) -> int:
    """The f-wide tensors a dense SwiGLU MLP saves for one micro-batch on one tensor-parallel
    rank (part of :func:`layer_bytes`)."""
    tokens = shape.micro_batch_size * shape.sequence_length
    f = model.ffn_hidden_size // parallel.tensor_model_parallel_size
    return SWIGLU_TENSORS[shape.attention] * tokens * f * DTYPE_BYTES[model.params_dtype]


def moe_tokens(parallel: ParallelConfig, shape: ActivationShape) -> int:
    """Tokens of one micro-batch that reach an MoE layer on one rank (its sequence-parallel
    slice: Megatron's MoE layer needs sequence parallelism when TP > 1)."""
    tokens = shape.micro_batch_size * shape.sequence_length
    return tokens // parallel.tensor_model_parallel_size if parallel.sequence_parallel else tokens


def stage_bytes(
    model: ModelConfig,
    parallel: ParallelConfig,
    shape: ActivationShape,
    pp_rank: int,
    layers: int,
    expert_load: float = 1.0,
    recompute: bool = False,
) -> int:
    """Peak activation bytes of pipeline stage ``pp_rank`` holding ``layers`` decoder layers
    (``expert_load``: see :func:`~bapo_megatron.planning.moe_memory.expert_token_copies`;
    ``recompute``: ``actor.recompute_activations``)."""
    t = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size
    e = DTYPE_BYTES[model.params_dtype]
    tokens = shape.micro_batch_size * shape.sequence_length
    norm_tokens = tokens // t if parallel.sequence_parallel else tokens
    dense_layer = layer_bytes(model, parallel, shape)
    sparse = stage_moe_layers(model, parallel, pp_rank)
    sparse_layer = dense_layer
    if sparse:
        moe = moe_mlp_bytes(
            moe_tokens(parallel, shape),
            model,
            parallel,
            e,
            SWIGLU_TENSORS[shape.attention],
            expert_load,
        )
        sparse_layer += moe - dense_mlp_bytes(model, parallel, shape)
    if recompute:
        per_micro_batch = layers * norm_tokens * model.hidden_size * e
        recomputed = max(dense_layer if layers > sparse else 0, sparse_layer if sparse else 0)
    else:
        per_micro_batch = (layers - sparse) * dense_layer + sparse * sparse_layer
        recomputed = 0
    if pp_rank == 0:
        per_micro_batch += norm_tokens * model.hidden_size * e
    last = pp_rank == pp - 1
    if last:
        per_micro_batch += 2 * norm_tokens * model.hidden_size * e
    in_flight = min(pp - pp_rank, max(1, shape.micro_batches))
    factor = 1 + (pp - 1) / (pp * vpp) if vpp else 1
    total = int(per_micro_batch * in_flight * factor) + recomputed
    if last:  # one micro-batch's logits at a time: the loss runs right after its forward
        vocab = model.vocab_size // t
        total += tokens * vocab * e + (tokens * vocab * _FP32 if e < _FP32 else 0)
    return total
