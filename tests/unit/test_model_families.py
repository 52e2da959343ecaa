"""The Qwen3 and Llama 3.x families: their config.json read into ModelConfig (both RoPE
spellings), written back for transformers, turned into Megatron's TransformerConfig; Llama 3.x's
rotary frequencies computed as transformers computes them (not as megatron-core's fixed-factor
scaling does); and what neither can represent refused naming the file and the field.
(The conversion, logits and training tests of these families run with the other families'.)"""

from __future__ import annotations

import json

import pytest
import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.config.rope import Llama3RopeScaling
from tests.helpers import hf_models
from tests.unit.test_model_config import LLAMA_3_8B_STYLE, QWEN25_05B_STYLE

# Qwen3-32B's shape: head_dim 128 is not hidden / heads (80).
QWEN3_32B_STYLE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "max_position_embeddings": 40960,
    "max_window_layers": 64,
    "num_attention_heads": 64,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}
LLAMA3_SCALING = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# Llama 3.2 3B's shape, in the transformers 4 spelling (top-level rope_theta, rope_scaling).
LLAMA_32_3B_STYLE = {
    **LLAMA_3_8B_STYLE,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 24,
    "num_hidden_layers": 28,
    "head_dim": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "rope_scaling": LLAMA3_SCALING,
}


def write_config(tmp_path, content: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    return path


# ------------------------------------------------------------------------ reading and writing


def test_qwen3_config_json_with_its_own_head_dim(tmp_path):
    cfg = ModelConfig.from_hf_config(write_config(tmp_path, QWEN3_32B_STYLE))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (
        "qwen3",
        5120,
        64,
        128,
    )
    assert cfg.qk_layernorm is True and cfg.qkv_bias is False and cfg.rope_scaling is None
    assert (cfg.rope_theta, cfg.num_query_groups, cfg.tie_word_embeddings) == (1e6, 8, False)
    tied = ModelConfig.from_hf_config({**QWEN3_32B_STYLE, "tie_word_embeddings": True})
    assert tied.tie_word_embeddings is True
    # the other families keep hidden / heads, and no q/k norm
    assert ModelConfig.from_hf_config(QWEN25_05B_STYLE).qk_layernorm is False
    assert ModelConfig.from_hf_config(LLAMA_3_8B_STYLE).qk_layernorm is False


def test_llama3_rope_scaling_in_both_spellings():
    expected = Llama3RopeScaling(
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    old = ModelConfig.from_hf_config(LLAMA_32_3B_STYLE)
    assert old.rope_scaling == expected and old.rope_theta == 5e5 and old.head_dim == 128
    # transformers 5: base and scaling inside rope_parameters (`type` is the older key name)
    new = {k: v for k, v in LLAMA_32_3B_STYLE.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**LLAMA3_SCALING, "rope_theta": 5e5}
    assert ModelConfig.from_hf_config(new) == old
    both = {**LLAMA_32_3B_STYLE, "rope_parameters": new["rope_parameters"]}
    assert ModelConfig.from_hf_config(both) == old  # both spellings, agreeing
    legacy = {**LLAMA3_SCALING, "type": "llama3"}
    legacy.pop("rope_type")
    assert ModelConfig.from_hf_config({**LLAMA_32_3B_STYLE, "rope_scaling": legacy}) == old


@pytest.mark.parametrize("style", ["qwen3", "llama32"])
def test_transformers_reads_back_what_to_hf_config_writes(style):
    import transformers

    hf = QWEN3_32B_STYLE if style == "qwen3" else LLAMA_32_3B_STYLE
    cfg = ModelConfig.from_hf_config(hf)
    written = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    assert type(written).__name__ == ("Qwen3Config" if style == "qwen3" else "LlamaConfig")
    assert ModelConfig.from_hf_config(written.to_dict()) == cfg


def test_yaml_model_section_takes_the_new_fields():
    from bapo_megatron.config.value_types import build_dataclass

    section = {
        "model_type": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "vocab_size": 128,
        "rope_scaling": {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"},
    }
    model = build_dataclass(ModelConfig, section, prefix="model")
    assert model.rope_scaling.factor == 32.0 and model.head_dim == 16
    with pytest.raises(ValueError, match=r"model.rope_scaling.high_freq_factor \(1.0\) must be"):
        build_dataclass(
            ModelConfig,
            {**section, "rope_scaling": {**section["rope_scaling"], "high_freq_factor": 1.0}},
            prefix="model",
        )
    qwen3 = build_dataclass(
        ModelConfig, {**section, "model_type": "qwen3", "head_dim": 32}, prefix="model"
    )
    assert qwen3.head_dim == 32 and qwen3.qk_layernorm
    with pytest.raises(ValueError, match=r"model.head_dim \(32\) must be hidden_size / num_att"):
        build_dataclass(ModelConfig, {**section, "head_dim": 32}, prefix="model")


def test_transformer_config_of_qwen3():
    from bapo_megatron.actor.megatron_config import to_transformer_config
    from bapo_megatron.config import ParallelConfig

    tc = to_transformer_config(
        ModelConfig.from_hf_config(QWEN3_32B_STYLE),
        ParallelConfig(tensor_model_parallel_size=8),
        use_cpu_initialization=True,
    )
    assert (tc.hidden_size, tc.num_attention_heads, tc.kv_channels) == (5120, 64, 128)
    assert tc.qk_layernorm is True and tc.add_qkv_bias is False and tc.layernorm_epsilon == 1e-6
    llama = to_transformer_config(
        ModelConfig.from_hf_config(LLAMA_32_3B_STYLE), ParallelConfig(), use_cpu_initialization=True
    )
    assert llama.qk_layernorm is False and llama.kv_channels == 128


# ------------------------------------------------------------------------ llama3 frequencies


def test_llama3_inverse_frequencies_are_transformers_not_megatrons():
    """transformers' inv_freq, bitwise, for factors that are not megatron-core's fixed ones
    (low 1, high 4, original context 8192); megatron-core's own scaling gives other values."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from bapo_megatron.models.rope_frequencies import rope_inverse_frequencies

    hf_model = hf_models.build_hf_model("llama32-tied")
    expected = hf_model.model.rotary_emb.inv_freq
    assert hf_model.config.rope_parameters["low_freq_factor"] != 1.0  # not Megatron's values
    model = ModelConfig.from_hf_config(hf_model.config.to_dict())
    ours = rope_inverse_frequencies(model)
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    plain = rope_inverse_frequencies(
        ModelConfig.from_hf_config(
            {**hf_model.config.to_dict(), "rope_parameters": {"rope_theta": 1e4}}
        )
    )
    # every band is exercised: kept, interpolated, divided by the factor
    assert ours[0] == plain[0] and torch.equal(ours[2:], plain[2:] / 4)
    assert plain[1] / 4 < ours[1] < plain[1]
    megatron = RotaryEmbedding(
        kv_channels=model.head_dim,
        rotary_percent=1.0,
        rotary_base=model.rope_theta,
        rope_scaling=True,
        rope_scaling_factor=model.rope_scaling.factor,
        use_cpu_initialization=True,
    )
    assert not torch.allclose(megatron.inv_freq, expected)
    # and plain RoPE is Megatron's own (left as Megatron computes it)
    assert torch.equal(
        RotaryEmbedding(
            kv_channels=model.head_dim,
            rotary_percent=1.0,
            rotary_base=1e4,
            use_cpu_initialization=True,
        ).inv_freq,
        plain,
    )


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "base,change,message",
    [
        (
            "llama32",
            {"rope_scaling": {**LLAMA3_SCALING, "rope_type": "yarn"}},
            "rope_scaling.rope_type='yarn' is not supported",
        ),
        (
            "llama32",
            {"rope_scaling": {**LLAMA3_SCALING, "beta_fast": 32}},
            "rope_scaling.beta_fast is not supported for rope_type 'llama3'",
        ),
        (
            "llama32",
            {"rope_scaling": {**LLAMA3_SCALING, "factor": 0.5}},
            "model.rope_scaling.factor must be a finite number >= 1",
        ),
        (
            "llama32",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
            "rope_scaling={'factor': 32.0",  # ... and rope_parameters= ... disagree
        ),
        (
            "llama32",
            {"partial_rotary_factor": 0.5},
            "partial_rotary_factor=0.5 is not supported",
        ),
        ("llama32", {"rope_scaling": "llama3"}, "rope_scaling must be a mapping or null"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        (
            "qwen3",
            {"layer_types": ["full_attention"] * 63 + ["sliding_attention"]},
            "layer_types=['full_attention'",
        ),
        ("qwen3", {"num_experts": 128}, "num_experts=128 is not supported (mixture-of-experts"),
        ("qwen3", {"num_experts_per_tok": 8}, "num_experts_per_tok=8 is not supported"),
        ("llama32", {"num_local_experts": 8}, "num_local_experts=8 is not supported"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported (qwen3's"),
        ("qwen3", {"head_dim": 127}, "model: the head dimension head_dim = 127 must be even"),
        (
            "qwen2",
            {"head_dim": 128},
            "head_dim=128 is not supported (must equal hidden_size / num_attention_heads = 64)",
        ),
    ],
)
def test_what_cannot_be_represented_is_refused_naming_the_file_and_field(
    tmp_path, base, change, message
):
    hf = {"llama32": LLAMA_32_3B_STYLE, "qwen3": QWEN3_32B_STYLE, "qwen2": QWEN25_05B_STYLE}[base]
    path = write_config(tmp_path, {**hf, **change})
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_fields_present_but_switched_off_are_accepted():
    """DeepSeek-R1-Distill-Qwen and Qwen2.5 carry a sliding_window with use_sliding_window
    false; transformers writes rope_scaling null, zero experts and full-attention layer types."""
    off = {
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 21,
        "rope_scaling": None,
        "num_experts": 0,
        "layer_types": ["full_attention"] * 64,
    }
    reference = ModelConfig.from_hf_config(QWEN3_32B_STYLE)
    assert ModelConfig.from_hf_config({**QWEN3_32B_STYLE, **off}) == reference
    qwen2 = ModelConfig.from_hf_config(QWEN25_05B_STYLE)
    assert ModelConfig.from_hf_config({**QWEN25_05B_STYLE, **off}) == qwen2
