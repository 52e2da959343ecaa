"""The one conversion from this project's configuration to Megatron-Core's ``TransformerConfig``.

Megatron's config has some 250 fields; they stay here. Everything else in the project speaks
:class:`~bapo_megatron.config.ModelConfig` and :class:`~bapo_megatron.config.ParallelConfig`.
Fields that are arguments of ``GPTModel`` rather than of the config (vocabulary size, RoPE base,
tied embeddings) are passed by :mod:`bapo_megatron.actor.model`, which also installs Llama 3.x's
RoPE scaling (:mod:`bapo_megatron.models.rope_frequencies`: Megatron's own fixes three of its
four parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.distributed.device import uses_cuda

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _leave_as_allocated(weight: torch.Tensor) -> None:
    """The init method of a model whose weights are all loaded next: no random draw."""


def to_transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    use_cpu_initialization: bool | None = None,
    initialize: bool = True,
    recompute_activations: bool = False,
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for a Llama/Qwen2/Qwen3 decoder split as ``parallel``
    says.

    Architecture: pre-norm RMSNorm (``layernorm_epsilon`` = rms_norm_eps), SwiGLU MLP
    (``gated_linear_unit`` with SiLU), grouped-query attention (``num_query_groups``), no bias on
    any linear layer except q/k/v when ``model.qkv_bias`` (Qwen2), an RMSNorm of each query and
    key head when ``model.qk_layernorm`` (Qwen3, same epsilon), ``head_dim`` channels per head
    (``kv_channels``, which Qwen3 sets apart from hidden / heads). Dropout is off: the policy's
    log-probs must not depend on which pass computed them.

    ``use_cpu_initialization`` (default: when ``parallel.device`` resolves to the CPU) makes
    every rank build the full weight on the CPU and keep its slice; on CPU it is the only way.
    ``initialize=False`` leaves the weights as allocated, for callers that overwrite every
    parameter right after the build. (Not through ``perform_initialization=False``: Megatron
    sets the tensor-parallel attributes of its weights, which grad-norm and optimizer code read,
    only in the init functions that flag skips; a no-op init method keeps them.) The fp8 fields
    of ``parallel`` are passed through unchanged (Megatron hands them to Transformer Engine).
    ``recompute_activations`` keeps only each layer's input in the forward pass and recomputes
    the layer in the backward pass (Megatron's full, uniform recompute, one layer per block).

    Mixture of experts (``model.moe``, :func:`moe_fields`): Megatron's MoE layer with a softmax
    top-k router and one SwiGLU MLP per expert.
    """
    if use_cpu_initialization is None:
        use_cpu_initialization = not uses_cuda(parallel.device)
    dtype = _DTYPES[model.params_dtype]
    return TransformerConfig(
        # architecture
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        # parallel layout
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=use_cpu_initialization,
        **(
            {}
            if initialize
            else {
                "init_method": _leave_as_allocated,
                "output_layer_init_method": _leave_as_allocated,
                "embedding_init_method": _leave_as_allocated,
            }
        ),
        # No CUDA graphs; the default "full" only triggers a deprecation warning.
        cuda_graph_scope=[],
        **(
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
            if recompute_activations
            else {}
        ),
        # Batched p2p posts a send to the next and one to the previous stage together; at PP2
        # both are the same peer, and gloo (CPU) matches same-tag messages in posting order, so
        # the interleaved schedule received gradients as activations. Unbatched p2p posts them
        # in an order both peers agree on. NCCL (GPU) keeps Megatron's batched default.
        batch_p2p_comm=uses_cuda(parallel.device),
        # FP8 through Transformer Engine (validate_layout refuses it where it cannot run)
        fp8=parallel.fp8,
        fp8_recipe=parallel.fp8_recipe,
        fp8_amax_history_len=parallel.fp8_amax_history_len,
        fp8_amax_compute_algo=parallel.fp8_amax_compute_algo,
        **moe_fields(model, parallel),
    )


def moe_fields(model: ModelConfig, parallel: ParallelConfig) -> dict:
    """Megatron's MoE fields for ``model.moe`` (none for a dense model).

    - Experts: ``num_moe_experts`` SwiGLU MLPs of width ``moe_ffn_hidden_size``, in the layers
      ``moe_layer_freq`` marks (HF's decoder_sparse_step / mlp_only_layers rule, as a list).
    - Router: softmax scores, top-``moe_router_topk``; HF's ``norm_topk_prob`` (renormalize the
      chosen experts' weights) is Megatron's softmax *after* the top-k
      (``moe_router_pre_softmax=False``), and without it the softmax over all experts before the
      top-k. Scores in float32 (``moe_router_dtype``), as transformers computes them.
    - No token dropping (no capacity factor): every token reaches its k experts, as in HF.
    - The load-balancing loss is not Megatron's (``moe_router_load_balancing_type="none"``):
      the actor adds its own term with explicit scaling
      (:mod:`bapo_megatron.actor.moe_aux_loss`), since Megatron's scales its gradient for a
      per-token loss that the BAPO loss is not.
    - Experts are ``SequentialMLP`` (``moe_grouped_gemm=False``), the implementation that runs
      without Transformer Engine and whose parameter names the name map knows.
    """
    moe = model.moe
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.moe_intermediate_size,
        "moe_layer_freq": [int(sparse) for sparse in moe.moe_layer_pattern(model.num_layers)],
        "moe_router_topk": moe.num_experts_per_tok,
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": parallel.moe_token_dispatcher,
        "moe_grouped_gemm": False,
        # Each router gets Megatron's RouterReplay; idle (live routing) until the actor's
        # routing replay sets an action (bapo_megatron.actor.routing_replay).
        "moe_enable_routing_replay": True,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
    }
