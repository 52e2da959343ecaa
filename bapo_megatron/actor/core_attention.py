"""Causal core attention for Megatron's local layer spec, on ``scaled_dot_product_attention``.

:class:`SdpaCoreAttention` takes the place of Megatron-Core 0.16.1's
``megatron.core.transformer.dot_product_attention.DotProductAttention`` (same constructor and
``forward``), which materialises the [b, heads, s, s] scores and probabilities and refuses packed
sequences. Here the attention is one torch call that keeps no s x s tensor where a fused kernel
exists (CPU flash attention, CUDA flash or memory-efficient attention), and packed (THD) input
is supported, each sequence attending causally to itself only.

Inputs, as ``Attention.forward`` passes them (np query heads and ng query groups on this
tensor-parallel rank, hn the head size; query head h reads KV group h // (np / ng), the order of
Megatron's ``repeat_interleave``):

- padded (``packed_seq_params`` None): query [sq, b, np, hn], key/value [sk, b, ng, hn]
  -> [sq, b, np * hn];
- packed (``packed_seq_params.qkv_format == "thd"``, batch dimension squeezed): query
  [t, np, hn], key/value [t, ng, hn] -> [t, np * hn]. Sequence i holds tokens
  ``cu[i]:cu[i + 1]`` of ``cu = cu_seqlens_q_padded`` (or ``cu_seqlens_q`` when there is no
  padded one), as Megatron's rotary embedding reads them; the padding tokens at the end of a
  padded sequence attend to their sequence only, and no real token sees them.

What matches Megatron's module: the softmax scale (``softmax_scale``, else 1 / sqrt(kv_channels);
``apply_query_key_layer_scaling`` divides the scores by the layer number before the softmax and
multiplies them by it again inside it, a protection against fp16 overflow that leaves the same
product, so it changes nothing here), the causal mask of the constructor's ``attn_mask_type``
(Megatron fills with -10000 where this uses -inf; both give a zero probability, and a causal row
always keeps its diagonal), and attention dropout on the probabilities in training only, drawn
inside Megatron's RNG tracker fork unless sequence parallelism is on, as Megatron draws it.
Numerically the softmax runs in float32 for bf16 input (Megatron's ``attention_softmax_in_fp32``
default). Refused with ``ValueError`` rather than computed differently: an explicit
``attention_mask``, ``attention_bias``, a mask type other than causal (``padding_causal``,
Megatron's name for the causal mask of packed sequences, is accepted too), sliding windows,
softmax types other than vanilla, context parallelism, cross attention (sq != sk), and packed
formats other than THD.

Packed sequences, per device:

- CUDA, fp16/bf16, no dropout, head size a multiple of 8 up to 256: one call of
  ``torch.nn.attention.varlen.varlen_attn`` (flash attention over cumulative lengths; causal is
  ``window_size=(-1, 0)``), when the installed torch has it. It needs the longest sequence:
  ``packed_seq_params.max_seqlen_q`` / ``max_seqlen_kv`` (Megatron's contract: the longest of
  the boundaries used, padded ones when given), else computed here with one device sync.
- Otherwise one SDPA call per sequence, after one ``.tolist()`` of the boundaries: a single
  call with a [t, t] block-diagonal causal mask computes all t^2 scores, the per-sequence calls
  only the sum of the squared lengths, and on a CPU the mask was 10-30x slower and took 10x the
  memory (docs/benchmarks.md, "Packed attention on the CPU").
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


@functools.cache
def varlen_attention():
    """torch's flash attention over cumulative lengths (``torch.nn.attention.varlen``, torch >=
    2.10, CUDA only), or None where torch lacks it. Imported at the first CUDA call, not with
    this module: it imports TorchDynamo (about 3 s of CPU), which runs on the CPU never use."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - the pinned torch has it
        return None
    return varlen_attn


CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
"""Mask types this module computes: both mean "causal within each sequence" here."""

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


class SdpaCoreAttention(MegatronModule):
    """Causal self-attention core for padded (sbhd) and packed (THD) input; see the module
    docstring for shapes, Megatron equivalences and refusals. No parameters, no state."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SdpaCoreAttention: context_parallel_size must be 1 (context parallelism needs "
                f"Transformer Engine's attention), got {config.context_parallel_size}"
            )
        if attn_mask_type not in CAUSAL_MASK_TYPES:
            raise ValueError(
                f"SdpaCoreAttention: attn_mask_type {attn_mask_type} is not supported; "
                "only causal self-attention (GPT) is"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SdpaCoreAttention: softmax_type {config.softmax_type!r} is not supported; "
                "only 'vanilla' is"
            )
        self.layer_number = max(1, layer_number)
        if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number
        ):
            raise ValueError(
                f"SdpaCoreAttention: window_size {config.window_size} (sliding-window "
                "attention) is not supported"
            )
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused, as in Megatron's module

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp  # read by MegatronModule.sharded_state_dict
        tp_size = pg_collection.tp.size()
        # Megatron's module's per-partition sizes, under its attribute names
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # The scale applied to q.k: Megatron's, with its layer-number scaling cancelled out
        # (module docstring).
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.softmax_scale = softmax_scale
        self.attention_dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention output: [sq, b, np * hn] for padded input, [t, np * hn] for THD."""
        if attention_mask is not None:
            raise ValueError(
                "SdpaCoreAttention: an explicit attention_mask is not supported; the causal mask "
                "is built in (pass None)"
            )
        if attention_bias is not None:
            raise ValueError("SdpaCoreAttention: attention_bias is not supported")
        if attn_mask_type is not None and attn_mask_type not in CAUSAL_MASK_TYPES:
            raise ValueError(
                f"SdpaCoreAttention: attn_mask_type {attn_mask_type} is not supported; "
                "only causal self-attention (GPT) is"
            )
        if query.size(-2) % key.size(-2) or key.shape != value.shape:
            raise ValueError(
                f"SdpaCoreAttention: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                f"value {tuple(value.shape)} do not form grouped-query attention"
            )
        dropout_p = self.attention_dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            if packed_seq_params is None:
                return self._padded(query, key, value, dropout_p)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(
                    "SdpaCoreAttention: packed_seq_params.qkv_format "
                    f"{packed_seq_params.qkv_format!r} is not supported; only 'thd' is"
                )
            return self._packed(query, key, value, packed_seq_params, dropout_p)

    def _dropout_rng(self, dropout_p: float) -> contextlib.AbstractContextManager:
        """Where the dropout mask is drawn: Megatron draws it in the tensor-parallel RNG
        tracker's state (ranks of a TP group drop different heads' probabilities) unless
        sequence parallelism is on; without dropout nothing is drawn."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _padded(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float
    ) -> torch.Tensor:
        sq, b, heads, hn = query.shape
        if key.size(0) != sq:
            raise ValueError(
                f"SdpaCoreAttention: {sq} queries and {key.size(0)} keys; only self-attention "
                "(as many keys as queries) is supported"
            )
        # [s, b, heads, hn] -> [b, heads, s, hn], SDPA's layout (views; the kernel takes strides)
        context = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            key.permute(1, 2, 0, 3),
            value.permute(1, 2, 0, 3),
            dropout_p=dropout_p,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=heads != key.size(2),
        )
        # [b, heads, sq, hn] -> [sq, b, heads * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: PackedSeqParams,
        dropout_p: float,
    ) -> torch.Tensor:
        if query.dim() != 3:
            raise ValueError(
                "SdpaCoreAttention: THD query must be [t, heads, head size] (the batch dimension "
                f"squeezed), got {tuple(query.shape)}"
            )
        t, heads, hn = query.shape
        if key.size(0) != t:
            raise ValueError(f"SdpaCoreAttention: {t} query tokens and {key.size(0)} key tokens")
        cu_q = _first_given(params.cu_seqlens_q_padded, params.cu_seqlens_q)
        if cu_q is None:
            raise ValueError("SdpaCoreAttention: THD input needs packed_seq_params.cu_seqlens_q")
        cu_kv = _first_given(params.cu_seqlens_kv_padded, params.cu_seqlens_kv, cu_q)
        if self._varlen_applies(query, dropout_p):
            context = self._varlen(query, key, value, cu_q, cu_kv, params)
        else:
            context = self._per_sequence(query, key, value, cu_q, cu_kv, dropout_p)
        return context.reshape(t, heads * hn)

    def _varlen_applies(self, query: torch.Tensor, dropout_p: float) -> bool:
        """Whether torch's varlen flash attention takes this call: it runs on CUDA in half
        precision only, without dropout (its dropout is fixed at 0), for flash's head sizes."""
        hn = query.size(-1)
        return (
            query.is_cuda
            and query.dtype in _VARLEN_DTYPES
            and dropout_p == 0.0
            and hn % 8 == 0
            and hn <= 256
            and varlen_attention() is not None
        )

    def _varlen(self, query, key, value, cu_q, cu_kv, params: PackedSeqParams) -> torch.Tensor:
        max_q, max_kv = params.max_seqlen_q, params.max_seqlen_kv
        if max_q is None:
            max_q = int((cu_q[1:] - cu_q[:-1]).max())  # one device sync
        if max_kv is None:
            max_kv = max_q if cu_kv is cu_q else int((cu_kv[1:] - cu_kv[:-1]).max())
        return varlen_attention()(
            query,
            key,
            value,
            cu_q.to(torch.int32),
            cu_kv.to(torch.int32),
            int(max_q),
            int(max_kv),
            scale=self.softmax_scale,
            window_size=(-1, 0),  # causal
            enable_gqa=query.size(1) != key.size(1),
        )

    def _per_sequence(self, query, key, value, cu_q, cu_kv, dropout_p: float) -> torch.Tensor:
        bounds = cu_q.tolist()  # the one host copy of the boundaries
        if cu_kv is not cu_q and cu_kv.tolist() != bounds:
            raise ValueError(
                "SdpaCoreAttention: query and key/value sequence boundaries differ; only "
                "self-attention is supported"
            )
        if (
            bounds[0] != 0
            or bounds[-1] != query.size(0)
            or any(a > b for a, b in zip(bounds, bounds[1:]))
        ):
            raise ValueError(
                f"SdpaCoreAttention: sequence boundaries {bounds} do not cover the "
                f"{query.size(0)} packed tokens from 0 in order"
            )
        gqa = query.size(1) != key.size(1)
        pieces = []
        for start, end in zip(bounds, bounds[1:]):
            if start == end:
                continue
            # [L, heads, hn] -> [heads, L, hn] and back
            piece = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1),
                key[start:end].transpose(0, 1),
                value[start:end].transpose(0, 1),
                dropout_p=dropout_p,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
            pieces.append(piece.transpose(0, 1))
        if not pieces:  # no tokens at all
            return query.new_empty(0, query.size(1), value.size(2))
        return torch.cat(pieces)


def _first_given(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return next((tensor for tensor in tensors if tensor is not None), None)
