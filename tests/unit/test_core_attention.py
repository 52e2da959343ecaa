"""SdpaCoreAttention, the local layer spec's core attention, on the CPU.

- Padded input against Megatron's own ``DotProductAttention`` (the module it replaces), forward
  and input gradients, MHA and GQA, with the softmax scale variants Megatron has.
- Packed THD input against a float64 reference computed per sequence by plain math
  (softmax(q k^T * scale + causal mask) v), float32 and bf16, and against the same sequences run
  padded one at a time; padded sequence boundaries hide the padding from real tokens.
- Through a whole ``GPTModel`` built by the actor's ``build_model``: a packed row (THD, as
  ``packed_seq_params`` reaches the layers) gives the logits and parameter gradients of its
  sequences run one at a time.
- Dropout is drawn in Megatron's RNG tracker, in training only; what the module does not
  support is refused; the local layer spec (dense and MoE) builds it.
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from bapo_megatron.actor.core_attention import SdpaCoreAttention
from bapo_megatron.actor.megatron_config import to_transformer_config
from bapo_megatron.actor.model import build_model, layer_spec
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.config.moe import MoeConfig
from tests.helpers.tiny_models import tiny_model

HEAD_SIZE = 16
LENGTHS = [7, 1, 12, 3, 9]
"""Uneven packed sequence lengths, one of them a single token."""
FLOAT32 = dict(rtol=1e-5, atol=1e-5)
"""float32 against float32 (Megatron) or float64 (reference): a few float32 roundings of O(1)
values through two matrix products and a softmax of at most 24 keys."""
MODEL_FLOAT32 = dict(rtol=1e-4, atol=1e-4)
"""A whole float32 model run packed or per sequence: parameter gradients (up to ~40) are sums
over all tokens, accumulated in another order by the two runs."""
BF16 = dict(rtol=2e-2, atol=2e-2)
"""bf16 against the float64 reference: bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.004),
and inputs, output and gradients are each rounded to it."""


def attention_config(heads: int, groups: int, **changes) -> TransformerConfig:
    fields = dict(
        num_layers=4,
        hidden_size=heads * HEAD_SIZE,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        cuda_graph_scope=[],  # the default ("full") warns that it is deprecated
    )
    return TransformerConfig(**{**fields, **changes})


def build(module_class, config: TransformerConfig, layer_number: int = 1, **kwargs):
    return module_class(
        config=config,
        layer_number=layer_number,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        **kwargs,
    )


def random_qkv(generator, tokens: tuple[int, ...], heads: int, groups: int, dtype=torch.float32):
    """query [*tokens, heads, hn], key and value [*tokens, groups, hn], leaves with grads."""
    q = torch.randn(*tokens, heads, HEAD_SIZE, generator=generator)
    k = torch.randn(*tokens, groups, HEAD_SIZE, generator=generator)
    v = torch.randn(*tokens, groups, HEAD_SIZE, generator=generator)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def output_and_grads(module, qkv, cotangent, **forward_kwargs):
    """The module's output and the gradients of <output, cotangent> w.r.t. q, k, v."""
    out = module(*qkv, None, **forward_kwargs)
    grads = torch.autograd.grad(out, qkv, cotangent)
    return out.detach(), grads


def thd_params(bounds: list[int], padded_bounds: list[int] | None = None) -> PackedSeqParams:
    cu = torch.tensor(bounds, dtype=torch.int32)
    cu_padded = None if padded_bounds is None else torch.tensor(padded_bounds, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
    )


def cumulative(lengths: list[int]) -> list[int]:
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def reference_thd(q, k, v, bounds: list[int], scale: float) -> torch.Tensor:
    """Per-sequence causal attention in float64 by plain math: [t, heads, hn] q and
    [t, groups, hn] k, v -> [t, heads * hn]; query head h reads KV group h // (heads / groups)."""
    q, k, v = (x.double() for x in (q, k, v))
    heads, groups = q.size(1), k.size(1)
    outputs = []
    for start, end in zip(bounds, bounds[1:]):
        n = end - start
        future = torch.ones(n, n, dtype=torch.bool).triu(diagonal=1)
        heads_out = []
        for h in range(heads):
            g = h // (heads // groups)
            scores = q[start:end, h] @ k[start:end, g].T * scale
            probs = torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)
            heads_out.append(probs @ v[start:end, g])
        outputs.append(torch.cat(heads_out, dim=-1))
    return torch.cat(outputs)


# ------------------------------------------------------------------ padded, against Megatron


@pytest.mark.parametrize(
    "heads,groups,layer_number,changes,softmax_scale",
    [
        (4, 4, 1, {}, None),
        (6, 2, 3, {"apply_query_key_layer_scaling": True}, None),
        (4, 2, 2, {}, 0.3),
    ],
    ids=["mha", "gqa-layer-scaling", "gqa-softmax-scale"],
)
def test_padded_matches_megatron_dot_product_attention(
    context, heads, groups, layer_number, changes, softmax_scale
):
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    config = attention_config(heads, groups, **changes)
    ours = build(SdpaCoreAttention, config, layer_number, softmax_scale=softmax_scale)
    megatron = build(DotProductAttention, config, layer_number, softmax_scale=softmax_scale)
    g = torch.Generator().manual_seed(101)
    seq, batch = 24, 3
    qkv = random_qkv(g, (seq, batch), heads, groups)
    cotangent = torch.randn(seq, batch, heads * HEAD_SIZE, generator=g)
    out, grads = output_and_grads(ours, qkv, cotangent)
    expected_out, expected_grads = output_and_grads(megatron, qkv, cotangent)
    assert out.shape == (seq, batch, heads * HEAD_SIZE)
    torch.testing.assert_close(out, expected_out, **FLOAT32)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, **FLOAT32)


# -------------------------------------------------------- packed, against float64 by hand


@pytest.mark.parametrize(
    "heads,groups,dtype,tolerance",
    [
        (4, 4, torch.float32, FLOAT32),
        (6, 2, torch.float32, FLOAT32),
        (6, 2, torch.bfloat16, BF16),
    ],
    ids=["mha-float32", "gqa-float32", "gqa-bf16"],
)
def test_packed_matches_float64_reference_per_sequence(context, heads, groups, dtype, tolerance):
    module = build(SdpaCoreAttention, attention_config(heads, groups))
    g = torch.Generator().manual_seed(202)
    bounds = cumulative(LENGTHS)
    qkv = random_qkv(g, (bounds[-1],), heads, groups, dtype)
    cotangent = torch.randn(bounds[-1], heads * HEAD_SIZE, generator=g)
    out, grads = output_and_grads(
        module, qkv, cotangent.to(dtype), packed_seq_params=thd_params(bounds)
    )

    leaves = [x.detach().double().requires_grad_() for x in qkv]
    expected = reference_thd(*leaves, bounds, 1 / math.sqrt(HEAD_SIZE))
    expected_grads = torch.autograd.grad(expected, leaves, cotangent.double())
    assert out.dtype == dtype and out.shape == (bounds[-1], heads * HEAD_SIZE)
    torch.testing.assert_close(out.double(), expected.detach(), **tolerance)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad, **tolerance)
    with torch.no_grad():
        again = module(*qkv, None, packed_seq_params=thd_params(bounds))
    assert torch.equal(again, out)


def test_padded_boundaries_hide_the_padding_from_real_tokens(context):
    """With ``cu_seqlens_q_padded``, sequences end at the padded boundaries: each real token's
    output is that of its sequence alone, whatever the padding tokens hold."""
    heads, groups = 4, 2
    module = build(SdpaCoreAttention, attention_config(heads, groups))
    g = torch.Generator().manual_seed(303)
    padding = [1, 3, 0, 1, 2]
    padded_bounds = cumulative([n + p for n, p in zip(LENGTHS, padding)])
    q, k, v = random_qkv(g, (padded_bounds[-1],), heads, groups)
    real = torch.cat([torch.arange(start, start + n) for start, n in zip(padded_bounds, LENGTHS)])
    params = thd_params(cumulative(LENGTHS), padded_bounds)
    out = module(q, k, v, None, packed_seq_params=params)
    expected = reference_thd(q[real], k[real], v[real], cumulative(LENGTHS), HEAD_SIZE**-0.5)
    torch.testing.assert_close(out[real].double(), expected.detach(), **FLOAT32)


def test_packed_row_equals_the_sequences_run_padded_one_at_a_time(context):
    heads, groups = 6, 3
    module = build(SdpaCoreAttention, attention_config(heads, groups))
    g = torch.Generator().manual_seed(404)
    bounds = cumulative(LENGTHS)
    qkv = random_qkv(g, (bounds[-1],), heads, groups)
    cotangent = torch.randn(bounds[-1], heads * HEAD_SIZE, generator=g)
    out, grads = output_and_grads(module, qkv, cotangent, packed_seq_params=thd_params(bounds))

    for start, end in zip(bounds, bounds[1:]):
        # the sequence alone as a padded batch of one: [L, 1, heads, hn]
        alone = [x.detach()[start:end, None].requires_grad_() for x in qkv]
        alone_out, alone_grads = output_and_grads(module, alone, cotangent[start:end, None])
        torch.testing.assert_close(out[start:end], alone_out[:, 0])
        for grad, alone_grad in zip(grads, alone_grads):
            torch.testing.assert_close(grad[start:end], alone_grad[:, 0])


def test_packed_row_through_gpt_model_equals_its_sequences_one_at_a_time(context):
    model = tiny_model(model_type="qwen3", head_dim=16, vocab_size=96, max_position_embeddings=64)
    chunk = build_model(model, ParallelConfig(), context)[0]
    g = torch.Generator().manual_seed(808)
    sequences = [torch.randint(0, model.vocab_size, (n,), generator=g) for n in LENGTHS]
    bounds = cumulative(LENGTHS)
    params = thd_params(bounds)
    params.max_seqlen_q = params.max_seqlen_kv = max(LENGTHS)
    weights = torch.randn(
        bounds[-1], model.vocab_size, generator=g
    )  # a loss that reads every logit

    def logits_and_grads(run) -> tuple[torch.Tensor, list[torch.Tensor]]:
        chunk.zero_grad()
        logits = run()  # [1, t, vocab]
        (logits[0] * weights).sum().backward()
        return logits.detach(), [p.grad.clone() for p in chunk.parameters()]

    packed, packed_grads = logits_and_grads(
        lambda: chunk(
            torch.cat(sequences)[None],
            torch.cat([torch.arange(n) for n in LENGTHS])[None],  # positions restart per sequence
            None,
            packed_seq_params=params,
        )
    )
    alone, alone_grads = logits_and_grads(
        lambda: torch.cat([chunk(s[None], torch.arange(len(s))[None], None) for s in sequences], 1)
    )
    torch.testing.assert_close(packed, alone, **MODEL_FLOAT32)
    for grad, alone_grad in zip(packed_grads, alone_grads):
        torch.testing.assert_close(grad, alone_grad, **MODEL_FLOAT32)


# ------------------------------------------------------------------------------ dropout


def test_dropout_is_drawn_in_the_rng_tracker_and_only_in_training(context):
    heads, groups = 4, 2
    module = build(SdpaCoreAttention, attention_config(heads, groups, attention_dropout=0.5))
    g = torch.Generator().manual_seed(505)
    q, k, v = (x.detach() for x in random_qkv(g, (10, 2), heads, groups))

    def run_from_seed(seed: int) -> torch.Tensor:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        default_state = torch.get_rng_state()
        out = module(q, k, v, None)
        assert torch.equal(torch.get_rng_state(), default_state)  # drawn in the tracker's state
        return out

    module.train()
    first, again, other = run_from_seed(21), run_from_seed(21), run_from_seed(22)
    assert torch.equal(first, again) and not torch.equal(first, other)
    module.eval()
    no_dropout = build(SdpaCoreAttention, attention_config(heads, groups))
    assert torch.equal(module(q, k, v, None), no_dropout(q, k, v, None))
    assert not torch.equal(first, no_dropout(q, k, v, None))


# ----------------------------------------------------------------------------- refusals


def _thd_inputs(heads=4, groups=2, tokens=6):
    g = torch.Generator().manual_seed(606)
    return [x.detach() for x in random_qkv(g, (tokens,), heads, groups)]


def _padded_inputs(seq=6, keys=6, heads=4, groups=2):
    g = torch.Generator().manual_seed(607)
    q = torch.randn(seq, 1, heads, HEAD_SIZE, generator=g)
    k = torch.randn(keys, 1, groups, HEAD_SIZE, generator=g)
    return q, k, k.clone()


FORWARD_REFUSALS = {  # name: (attention_mask, other keyword arguments, error message)
    "explicit-mask": (torch.zeros(1, 1, 6, 6, dtype=torch.bool), {}, "explicit attention_mask"),
    "attention-bias": (None, {"attention_bias": torch.zeros(1)}, "attention_bias"),
    "no-mask": (None, {"attn_mask_type": AttnMaskType.no_mask}, "attn_mask_type"),
    "sbhd-packed": (None, {"packed_seq_params": PackedSeqParams(qkv_format="sbhd")}, "qkv_format"),
}


@pytest.mark.parametrize("case", FORWARD_REFUSALS)
def test_forward_refuses_what_it_does_not_compute(context, case):
    module = build(SdpaCoreAttention, attention_config(4, 2))
    mask, kwargs, message = FORWARD_REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        module(*_padded_inputs(), mask, **kwargs)


def test_forward_refuses_cross_attention_and_bad_boundaries(context):
    module = build(SdpaCoreAttention, attention_config(4, 2))
    with pytest.raises(ValueError, match="self-attention"):
        module(*_padded_inputs(seq=4, keys=6), None)
    q, k, v = _thd_inputs(tokens=6)
    with pytest.raises(ValueError, match="do not cover"):
        module(q, k, v, None, packed_seq_params=thd_params([0, 2, 5]))
    cross = thd_params([0, 2, 6])
    cross.cu_seqlens_kv = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="boundaries differ"):
        module(q, k, v, None, packed_seq_params=cross)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        module(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))


@pytest.mark.parametrize(
    "changes,kwargs,message",
    [
        ({"softmax_type": "off-by-one"}, {}, "softmax_type"),
        ({"window_size": (8, 0)}, {}, "window_size"),
        ({}, {"attn_mask_type": AttnMaskType.padding}, "attn_mask_type"),
    ],
    ids=["softmax-off-by-one", "sliding-window", "padding-mask"],
)
def test_construction_refuses_what_it_does_not_compute(context, changes, kwargs, message):
    config = attention_config(4, 2, **changes)
    arguments = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    with pytest.raises(ValueError, match=message):
        SdpaCoreAttention(**{**arguments, "attention_type": "self", **kwargs})


def test_construction_refuses_context_parallelism(context):
    config = attention_config(4, 2)
    config.context_parallel_size = 2  # set after validation: the module's own check is tested
    with pytest.raises(ValueError, match="context_parallel_size"):
        build(SdpaCoreAttention, config)


# ---------------------------------------------------------------------------- layer spec


def _core_attention(layer) -> type:
    return layer.submodules.self_attention.submodules.core_attention


def test_local_layer_specs_build_sdpa_core_attention():
    dense = ModelConfig(
        model_type="qwen3",
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=32,
    )
    assert _core_attention(layer_spec(dense, device="cpu")) is SdpaCoreAttention
    moe = ModelConfig(
        model_type="qwen3_moe",
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=32,
        moe=MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    )
    block = layer_spec(moe, to_transformer_config(moe, ParallelConfig()), device="cpu")
    assert len(block.layer_specs) == 4
    assert all(_core_attention(layer) is SdpaCoreAttention for layer in block.layer_specs)
    # Megatron's specs are copied, not changed
    assert _core_attention(get_gpt_layer_local_spec()) is DotProductAttention
