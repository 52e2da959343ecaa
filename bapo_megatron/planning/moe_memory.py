"""What the mixture-of-experts layers of a Qwen3-MoE model put on one rank, in the terms
Megatron-Core 0.16 lays them out by (``SequentialMLP`` experts, softmax top-k router, no token
dropping).

Parameters. Each MoE layer has a router weight [E, h] (E experts, hidden h), kept whole on every
rank of the stage (``TopKRouter``, in ``params_dtype``), and E SwiGLU experts of width f
(``moe_intermediate_size``): ``linear_fc1`` [2f, h] (gate and up) and ``linear_fc2`` [h, f], i.e.
3·h·f each. Expert parallelism (EP) gives each rank E / EP of them, expert tensor parallelism
(ETP) splits each one's matrices, so a rank of a stage with m MoE layers holds m·(E/EP)·3·h·f/ETP
expert parameters. The ranks holding the same experts form the expert data-parallel group of size
world / (PP·EP·ETP); Megatron's DDP keeps the experts' gradients in buffers of their own
(parameters with ``allreduce=False``, set when EP > 1) and the distributed optimizer shards their
state over that group (:mod:`~bapo_megatron.planning.shard_memory` computes the bytes from the
meta shards; :func:`expert_parameters` is the count they are checked against).

Activations. Per rank, T tokens reach an MoE layer per micro-batch (the sequence-parallel slice
when TP > 1; Megatron requires sequence parallelism there). The router saves its fp32 logits and
probabilities over all experts (T·E each: the softmax backward and this project's load-balancing
term read them). Each token goes to k experts (``num_experts_per_tok``); with expert TP the
dispatcher also gathers the copies over the ETP group, so a rank's experts process
N = T·k·ETP token copies when routing is balanced (``expert_load`` > 1 scales them for the
fullest rank: the ``moe/expert_load_max_over_mean`` the trainer logs). Each copy is saved as the
experts' input (h wide, the dispatcher's sorted copy), through the SwiGLU as the dense MLP saves
its tokens (the same count of f/ETP-wide tensors), plus the activation scaled by the copy's
routing probability (one more f/ETP-wide tensor, ``per_token_scale`` in Megatron's MLP), the
probability itself (fp32) and its int64 position in the permutation.

Dispatcher buffers. Transient, one layer at a time, so counted once per rank (not per layer or
micro-batch in flight): ``alltoall`` holds the permuted tokens it sends (T·k·h) and those it
receives (N·h / ETP, or N·h after the ETP all-gather), each with its fp32 probability;
``allgather`` gathers every token of the ETP·EP group (T·ETP·EP·h) with its fp32 probabilities
and boolean routing map over all experts, and its combine reduce-scatters the same tokens in fp32.
"""

from __future__ import annotations

from bapo_megatron.config import ModelConfig, ParallelConfig

_FP32 = 4
_INDEX = 8  # int64 positions of the permutation, kept for the unpermute's backward


def stage_layers(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Layers (from 0) of pipeline stage ``pp_rank``: with virtual pipelining, chunk v of the
    stage holds layers v·L/vpp + pp_rank·L/(pp·vpp) onward (Megatron's
    ``get_transformer_layer_offset``)."""
    pp = parallel.pipeline_model_parallel_size
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    per_chunk = model.num_layers // (pp * vpp)
    return [
        v * (model.num_layers // vpp) + pp_rank * per_chunk + i
        for v in range(vpp)
        for i in range(per_chunk)
    ]


def stage_moe_layers(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> int:
    """MoE layers among stage ``pp_rank``'s layers (0 for a dense model)."""
    if model.moe is None:
        return 0
    pattern = model.moe.moe_layer_pattern(model.num_layers)
    return sum(pattern[i] for i in stage_layers(model, parallel, pp_rank))


def expert_parameters(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> int:
    """Expert parameters one rank of stage ``pp_rank`` holds: its MoE layers x E/EP experts x
    3·h·f / ETP."""
    if model.moe is None:
        return 0
    moe = model.moe
    local_experts = moe.num_experts // parallel.expert_model_parallel_size
    per_expert = 3 * model.hidden_size * moe.moe_intermediate_size
    return (
        stage_moe_layers(model, parallel, pp_rank)
        * local_experts
        * per_expert
        // parallel.expert_tensor_parallel_size
    )


def router_parameters(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> int:
    """Router parameters on every rank of stage ``pp_rank`` (E·h per MoE layer, replicated)."""
    if model.moe is None:
        return 0
    return stage_moe_layers(model, parallel, pp_rank) * model.moe.num_experts * model.hidden_size


def expert_data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """Ranks holding the same experts: world / (PP·EP·ETP)."""
    return world_size // (parallel.pipeline_model_parallel_size * parallel.expert_parallel_size)


def expert_token_copies(
    tokens: int, model: ModelConfig, parallel: ParallelConfig, expert_load: float = 1.0
) -> int:
    """Token copies N the experts of one rank process per MoE layer and micro-batch, for
    ``tokens`` reaching the layer on that rank: T·k·ETP, times ``expert_load``."""
    copies = tokens * model.moe.num_experts_per_tok * parallel.expert_tensor_parallel_size
    return int(copies * expert_load)


def moe_mlp_bytes(
    tokens: int,
    model: ModelConfig,
    parallel: ParallelConfig,
    element_size: int,
    swiglu_tensors: int,
    expert_load: float = 1.0,
) -> int:
    """Bytes one MoE layer's router and experts save for backward on one rank, for ``tokens``
    reaching the layer there, activations of ``element_size`` bytes, and ``swiglu_tensors``
    f-wide tensors per token saved by a SwiGLU MLP (as the dense estimate counts them). The
    layer's attention and norms are counted as a dense layer's."""
    moe = model.moe
    router = tokens * moe.num_experts * 2 * _FP32
    copies = expert_token_copies(tokens, model, parallel, expert_load)
    width = moe.moe_intermediate_size // parallel.expert_tensor_parallel_size
    per_copy = (model.hidden_size + (swiglu_tensors + 1) * width) * element_size + _FP32 + _INDEX
    return router + copies * per_copy


def dispatcher_bytes(
    tokens: int,
    model: ModelConfig,
    parallel: ParallelConfig,
    element_size: int,
    expert_load: float = 1.0,
) -> int:
    """Peak bytes of the token dispatcher's buffers on one rank while one MoE layer dispatches
    or combines ``tokens`` (``parallel.moe_token_dispatcher``)."""
    moe, h = model.moe, model.hidden_size
    etp, ep = parallel.expert_tensor_parallel_size, parallel.expert_model_parallel_size
    if parallel.moe_token_dispatcher == "alltoall":
        sent = tokens * moe.num_experts_per_tok
        received = expert_token_copies(tokens, model, parallel, expert_load) // etp
        gathered = received * etp if etp > 1 else 0
        return (sent + received + gathered) * (h * element_size + _FP32)
    if parallel.moe_token_dispatcher == "allgather":
        everyone = tokens * etp * ep
        dispatch = everyone * (h * element_size + moe.num_experts * (_FP32 + 1))
        combine = everyone * h * _FP32
        return max(dispatch, combine)
    raise ValueError(
        "parallel.moe_token_dispatcher must be 'alltoall' or 'allgather', "
        f"got {parallel.moe_token_dispatcher!r}"
    )
