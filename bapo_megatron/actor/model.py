"""Build the policy as Megatron-Core ``GPTModel`` chunks for this rank's place in the layout.

The layer spec is Transformer Engine's when it is importable and a CUDA GPU is visible, otherwise
Megatron's local (plain torch) spec with RMSNorm, which is what runs on the CPU, with its core
attention replaced by :class:`~bapo_megatron.actor.core_attention.SdpaCoreAttention` (torch's
fused attention, and packed THD sequences, which Megatron's unfused module refuses); both carry
the per-head q/k RMSNorm of Qwen3 when ``qk_layernorm``. Rotary position embeddings use
``rope_theta``, and Llama 3.x's ``rope_scaling`` is installed the transformers way
(:mod:`bapo_megatron.models.rope_frequencies`); the output layer shares the embedding matrix when
``tie_word_embeddings``. Each chunk knows from the context whether it holds the embedding
(``pre_process``: first stage) and the output layer (``post_process``: last stage).

``forward(tokens [b, s], position_ids [b, s], attention_mask=None)`` of a last-stage chunk returns
logits ``[b, s, vocab_size / tp_size]``: each tensor-parallel rank holds a contiguous slice of the
vocabulary (``parallel_output``), which the log-prob code consumes without gathering.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from bapo_megatron.actor.core_attention import SdpaCoreAttention
from bapo_megatron.actor.megatron_config import to_transformer_config
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.device import uses_cuda
from bapo_megatron.distributed.layout import validate_layout
from bapo_megatron.megatron_patches.model_lifetime import release_with_the_model
from bapo_megatron.models.rope_frequencies import install_rope_frequencies

DEFAULT_SEED = 1234


def uses_transformer_engine(device: str = "auto") -> bool:
    """Whether models are built from Transformer Engine layers: TE is installed and the run's
    ``parallel.device`` setting ``device`` resolves to CUDA. A model built on the meta device
    (the layout planner's dry runs) gets the local spec."""
    if device == "meta":
        return False
    return uses_cuda(device) and importlib.util.find_spec("transformer_engine") is not None


def layer_spec(
    model: ModelConfig,
    config: TransformerConfig | None = None,
    *,
    pp_rank: int = 0,
    vp_stage: int | None = None,
    device: str = "auto",
) -> ModuleSpec | TransformerBlockSubmodules:
    """Megatron's decoder-layer spec for ``model``'s family on this machine: with a q/k RMSNorm
    module per attention layer for Qwen3 (``qk_layernorm``), an identity otherwise. A
    mixture-of-experts model gets the spec of its chunk's block instead (``config``, the
    pipeline rank and virtual stage say which layers): Megatron picks, per layer, the dense MLP
    or the experts from ``config.moe_layer_freq``. ``device``: the run's ``parallel.device``
    (Transformer Engine's layers only on CUDA). The local spec's core attention is
    :class:`SdpaCoreAttention` instead of Megatron's ``DotProductAttention``; Transformer
    Engine's spec keeps its own."""
    use_te = uses_transformer_engine(device)
    if model.is_moe:
        if config is None:
            raise ValueError("layer_spec: a mixture-of-experts model needs its TransformerConfig")
        block = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization="RMSNorm",
            vp_stage=vp_stage,
            pp_rank=pp_rank,
        )
        if use_te:
            return block
        layers = [_with_sdpa_core_attention(layer) for layer in block.layer_specs]
        return dataclasses.replace(block, layer_specs=layers)
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
    local = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=model.qk_layernorm)
    return _with_sdpa_core_attention(local)


def _with_sdpa_core_attention(layer: ModuleSpec) -> ModuleSpec:
    """A copy of the local spec's decoder layer ``layer`` whose self-attention builds
    :class:`SdpaCoreAttention` as its core attention (Megatron's specs are shared between
    layers, so they are copied, not changed)."""
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=SdpaCoreAttention),
    )
    return dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)
    )


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    context: ParallelContext,
    *,
    seed: int = DEFAULT_SEED,
    initialize: bool = True,
    recompute_activations: bool = False,
) -> list[GPTModel]:
    """This rank's model chunks: one ``GPTModel``, or ``virtual_pipeline_model_parallel_size``
    of them (Megatron's interleaved schedule takes the list).

    The layout is validated first (:func:`~bapo_megatron.distributed.layout.validate_layout`).
    Initial weights are a function of ``seed`` and the layout: a rebuild with the same seed and
    layout gives the same weights, but different layouts do not give the same full model
    (trained weights are loaded afterwards). The seed sets Megatron's RNG tracker and the default
    generator, offset per pipeline stage so that stages draw different layers; all
    tensor-parallel ranks of a stage share it, which ``use_cpu_initialization`` requires (each
    rank draws the full matrix and keeps its slice).

    ``initialize=False`` skips the random draws, for callers that load every parameter next (a
    checkpoint or HF folder): on the CPU they are most of the build time of a large model. A
    loader that missed a parameter would leave it as allocated, so loaders must cover them all
    (the HF and Megatron loaders do: one rule per parameter, strict state-dict loading).
    ``recompute_activations``: Megatron's full recompute (see ``to_transformer_config``).
    """
    validate_layout(model, parallel, context.world_size)
    if parallel != context.config:
        raise ValueError(
            "build_model: `parallel` differs from the layout the ParallelContext "
            "was initialized with"
        )
    config = to_transformer_config(
        model, parallel, initialize=initialize, recompute_activations=recompute_activations
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed + 100 * context.pp_rank)
    stages = [None] if context.vpp_size is None else list(range(context.vpp_size))
    chunks = [
        GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(
                model,
                config,
                pp_rank=context.pp_rank,
                vp_stage=vp_stage,
                device=context.device.type,
            ),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=context.is_first_stage(vp_stage),
            post_process=context.is_last_stage(vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=model.rope_theta,
            pg_collection=context.process_groups,
            vp_stage=vp_stage,
        ).to(context.device)
        for vp_stage in stages
    ]
    for chunk in chunks:
        install_rope_frequencies(chunk, model)
        _parameters_to(chunk, config.params_dtype)
        release_with_the_model(chunk)
    return chunks


def _parameters_to(chunk: GPTModel, dtype: torch.dtype) -> None:
    """Give every parameter the model's dtype. The local layer spec's norms are torch modules
    that create float32 weights whatever ``params_dtype`` says (Transformer Engine's norms take
    it); a bf16 model with float32 parameters breaks both Megatron 0.16 optimizers' checkpoints:
    the plain one cannot save them, and the distributed one numbers the optimizer state of a
    parameter group holding both dtypes in another order than it stores it (float32 shards
    first), so it saves one parameter's state under another's name, or fails an assertion.
    Buffers (the rotary frequencies) keep their float32."""
    for param in chunk.parameters():
        if param.dtype != dtype:
            param.data = param.data.to(dtype)


EXPERT_PARAMETER = ".mlp.experts.local_experts."
"""Part of the name of every expert parameter (``SequentialMLP``'s experts)."""


def global_parameter_name(chunk: GPTModel, local_name: str) -> str:
    """The name ``local_name`` of ``chunk`` has in the whole (TP1/PP1/EP1) model: decoder layers
    are numbered per chunk, and renumbered here by their global ``layer_number``; the experts of
    an MoE layer are numbered per expert-parallel rank, and renumbered by their global index.
    Accepts the chunk itself or a wrapper (DDP) whose ``module`` is the chunk."""
    model = getattr(chunk, "module", chunk)
    parts = local_name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
        if parts[3:6] == ["mlp", "experts", "local_experts"]:
            parts[6] = str(layer.mlp.local_expert_indices[int(parts[6])])
    return ".".join(parts)


def tensor_parallel_shard(
    name: str, full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """The slice of the whole-model tensor ``full`` that tensor-parallel rank ``tp_rank`` holds
    as ``param`` (named ``name``). For an expert's parameter, pass the expert tensor parallel
    rank and size (:func:`parameter_shard` chooses).

    Replicated parameters (norms) are whole. Split ones carry Megatron's ``partition_dim``: the
    vocabulary rows of embedding and output layer, the output rows of column-parallel layers and
    the input columns of row-parallel ones are contiguous chunks. The q/k/v rows are grouped per
    query group ([q_g, k_g, v_g] for g = 0..G-1), so a contiguous chunk holds whole groups. The
    SwiGLU fc1 stacks [gate; up]: each rank holds [gate_r; up_r].
    """
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # the dense MLP's and each expert's
        return torch.cat([half.chunk(tp_size, dim)[tp_rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp_size, dim)[tp_rank]


def parameter_shard(
    name: str, full: torch.Tensor, param: torch.nn.Parameter, context: ParallelContext
) -> torch.Tensor:
    """:func:`tensor_parallel_shard` with the group that splits ``param``: expert tensor
    parallel for an expert's matrices, tensor parallel for everything else."""
    if EXPERT_PARAMETER in "." + name:
        return tensor_parallel_shard(name, full, param, context.etp_rank, context.etp_size)
    return tensor_parallel_shard(name, full, param, context.tp_rank, context.tp_size)


@torch.no_grad()
def load_whole_model_weights(
    chunks: list[torch.nn.Module], weights: dict[str, torch.Tensor], context: ParallelContext
) -> None:
    """Copy this rank's shards of ``weights`` (every parameter of the TP1/PP1 model, by its
    Megatron name) into ``chunks``. With tied embeddings the last stage's output layer is the
    embedding matrix. Raises ``ValueError`` naming a missing tensor or a shape mismatch."""
    for chunk in chunks:
        for local_name, param in getattr(chunk, "module", chunk).named_parameters():
            name = global_parameter_name(chunk, local_name)
            if name == "output_layer.weight" and name not in weights:
                name = "embedding.word_embeddings.weight"  # tied: a copy on the last stage
            if name not in weights:
                raise ValueError(f"weights: no tensor for parameter {name!r}")
            shard = parameter_shard(local_name, weights[name], param, context)
            if shard.shape != param.shape:
                raise ValueError(
                    f"weights[{name!r}]: shard shape {tuple(shard.shape)} does not fit "
                    f"parameter shape {tuple(param.shape)} at TP rank {context.tp_rank}"
                )
            param.copy_(shard)
