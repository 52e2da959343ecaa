"""Model and parallel configuration: Hugging Face config.json reading, validation, layout checks,
and the one conversion to Megatron's TransformerConfig."""

from __future__ import annotations

import json

import pytest
import torch

from bapo_megatron.config import Config, ModelConfig, ParallelConfig
from bapo_megatron.config.loading import load_config
from bapo_megatron.distributed.layout import Accelerator, validate_layout

# Shapes of real checkpoints' config.json, reduced to what the readers look at.
LLAMA_3_8B_STYLE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
}
QWEN25_05B_STYLE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "torch_dtype": "bfloat16",
}

CPU_ONLY = Accelerator(transformer_engine=False, cuda=False, fp8_gpu=False)
HOPPER_WITH_TE = Accelerator(transformer_engine=True, cuda=True, fp8_gpu=True)


def tiny(**overrides) -> ModelConfig:
    values = {
        "model_type": "llama",
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "vocab_size": 128,
    }
    return ModelConfig(**{**values, **overrides})


def write_config(tmp_path, content: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return path


# ------------------------------------------------------------------------ from_hf_config


def test_llama_config_json_untied(tmp_path):
    cfg = ModelConfig.from_hf_config(write_config(tmp_path, LLAMA_3_8B_STYLE))
    assert cfg == ModelConfig(
        model_type="llama",
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        qkv_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        params_dtype="float32",
    )
    assert cfg.head_dim == 128


def test_qwen2_config_json_tied_from_its_folder(tmp_path):
    write_config(tmp_path, QWEN25_05B_STYLE)
    cfg = ModelConfig.from_hf_config(tmp_path, params_dtype="bfloat16")  # the checkpoint folder
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (
        "qwen2",
        24,
        896,
        4864,
    )
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim) == (14, 2, 64)
    assert cfg.qkv_bias is True and cfg.tie_word_embeddings is True
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.vocab_size) == (1e6, 1e-6, 151936)
    assert cfg.params_dtype == "bfloat16"


def test_llama_tied_and_qwen2_untied(tmp_path):
    llama = ModelConfig.from_hf_config({**LLAMA_3_8B_STYLE, "tie_word_embeddings": True})
    assert llama.tie_word_embeddings is True and llama.qkv_bias is False
    qwen = ModelConfig.from_hf_config({**QWEN25_05B_STYLE, "tie_word_embeddings": False})
    assert qwen.tie_word_embeddings is False and qwen.qkv_bias is True


def test_missing_kv_heads_means_multi_head_attention():
    hf = {k: v for k, v in LLAMA_3_8B_STYLE.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf_config(hf).num_query_groups == 32


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_hidden_layers": None}, "required field 'num_hidden_layers' is missing"),
        (
            {"model_type": "mistral"},
            "model_type 'mistral' is not supported; "
            "supported: ['llama', 'qwen2', 'qwen3', 'qwen3_moe']",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling.low_freq_factor is missing (rope_type 'llama3' needs",
        ),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        (
            {"head_dim": 64},
            "head_dim=64 is not supported (must equal hidden_size / num_attention_heads = 128)",
        ),
        (
            {"num_key_value_heads": 5},
            "model.num_query_groups (5) must divide model.num_attention_heads (32)",
        ),
    ],
)
def test_llama_errors_name_the_file_and_field(tmp_path, change, message):
    hf = {k: v for k, v in {**LLAMA_3_8B_STYLE, **change}.items() if v is not None}
    path = write_config(tmp_path, hf)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_size": "4096"}, "model.hidden_size: expected an integer, got '4096' (a string"),
        (
            {"rms_norm_eps": True},
            "model.rms_norm_eps: expected a number (float), got true (a boolean)",
        ),
        ({"num_hidden_layers": 32.0}, "model.num_layers: expected an integer, got 32.0 (a float)"),
    ],
)
def test_ill_typed_config_json_values_are_refused_like_yaml_ones(tmp_path, change, message):
    path = write_config(tmp_path, {**LLAMA_3_8B_STYLE, **change})
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(path)
    assert f"HF config {path}: {message}" in str(err.value)


def test_integer_config_json_floats_become_floats():
    cfg = ModelConfig.from_hf_config({**LLAMA_3_8B_STYLE, "rope_theta": 500000})
    assert cfg.rope_theta == 500000.0 and type(cfg.rope_theta) is float


def test_qwen2_sliding_window_is_refused():
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported"):
        ModelConfig.from_hf_config({**QWEN25_05B_STYLE, "use_sliding_window": True})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        ModelConfig.from_hf_config(bad)


# ------------------------------------------------------------------------ field validation


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model_type": "gpt2"}, "model.model_type must be one of"),
        ({"num_layers": 0}, "model.num_layers must be a positive integer"),
        (
            {"hidden_size": 66},
            "model.hidden_size (66) must be a multiple of model.num_attention_heads (4)",
        ),
        ({"num_query_groups": 3}, "model.num_query_groups (3) must divide"),
        ({"rms_norm_eps": 0.0}, "model.rms_norm_eps must be a finite number > 0"),
        ({"params_dtype": "float16"}, "model.params_dtype must be"),
    ],
)
def test_model_field_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        tiny(**overrides)
    assert message in str(err.value)


def test_qkv_bias_defaults_to_the_family():
    assert tiny(model_type="qwen2").qkv_bias is True
    assert tiny(model_type="llama").qkv_bias is False
    assert tiny(model_type="qwen2", qkv_bias=False).qkv_bias is False


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"tensor_model_parallel_size": 0},
            "parallel.tensor_model_parallel_size must be a positive integer",
        ),
        (
            {"sequence_parallel": True},
            "parallel.sequence_parallel=true needs parallel.tensor_model_parallel_size > 1",
        ),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            "needs parallel.pipeline_model_parallel_size > 1",
        ),
        (
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 1},
            "virtual_pipeline_model_parallel_size must be an integer >= 2",
        ),
        ({"fp8": "e5m2"}, "parallel.fp8 must be 'e4m3', 'hybrid' or null"),
        ({"fp8_recipe": "fast"}, "parallel.fp8_recipe must be one of"),
        ({"fp8_amax_compute_algo": "mean"}, "parallel.fp8_amax_compute_algo must be"),
    ],
)
def test_parallel_field_errors(overrides, message):
    with pytest.raises(ValueError) as err:
        ParallelConfig(**overrides)
    assert message in str(err.value)


def test_yaml_sections_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  model_type: qwen2\n  num_layers: 2\n  hidden_size: 64\n  ffn_hidden_size: 128\n"
        "  num_attention_heads: 4\n  num_query_groups: 2\n  vocab_size: 128\n"
        "parallel:\n  tensor_model_parallel_size: 2\n"
    )
    cfg = load_config(path, ["parallel.sequence_parallel=true", "model.params_dtype=bfloat16"])
    assert isinstance(cfg, Config)
    assert cfg.model.qkv_bias is True and cfg.model.params_dtype == "bfloat16"
    assert cfg.parallel.sequence_parallel is True and cfg.parallel.model_parallel_size == 2
    assert load_config().model is None  # the loss-only demo runs without a model
    with pytest.raises(ValueError, match="parallel: unknown field"):
        load_config(None, ["parallel.tp=2"])


# ------------------------------------------------------------------------ layout


def test_layout_returns_the_data_parallel_size():
    model = tiny(num_layers=4)
    layout = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )
    assert validate_layout(model, layout, 8, CPU_ONLY) == 2
    assert validate_layout(model, ParallelConfig(), 1, CPU_ONLY) == 1


@pytest.mark.parametrize(
    "model_overrides,parallel,world,message",
    [
        (
            {"num_attention_heads": 2, "num_query_groups": 2, "hidden_size": 64},
            {"tensor_model_parallel_size": 4},
            4,
            "model.num_attention_heads (2) is not divisible by "
            "parallel.tensor_model_parallel_size (4)",
        ),
        (
            {"num_query_groups": 1},
            {"tensor_model_parallel_size": 2},
            2,
            "model.num_query_groups (1) is not divisible by "
            "parallel.tensor_model_parallel_size (2)",
        ),
        (
            {"num_layers": 3},
            {"pipeline_model_parallel_size": 2},
            2,
            "model.num_layers (3) is not divisible by pipeline = 2",
        ),
        (
            {"num_layers": 4},
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4},
            2,
            "model.num_layers (4) is not divisible by pipeline x virtual pipeline = 2 x 4",
        ),
        (
            {},
            {"tensor_model_parallel_size": 2},
            3,
            "world size 3 is not divisible by tensor x pipeline x context parallel = 2 x 1 x 1 = 2",
        ),
        (
            {"vocab_size": 127},
            {"tensor_model_parallel_size": 2},
            2,
            "model.vocab_size (127) is not divisible by parallel.tensor_model_parallel_size (2)",
        ),
        (
            {},
            {"context_parallel_size": 2},
            2,
            "parallel.context_parallel_size=2 needs Transformer Engine on a CUDA GPU",
        ),
        (
            {},
            {"fp8": "hybrid"},
            1,
            "parallel.fp8='hybrid' needs Transformer Engine, which is not installed",
        ),
    ],
)
def test_bad_layouts_are_refused(model_overrides, parallel, world, message):
    with pytest.raises(ValueError) as err:
        validate_layout(tiny(**model_overrides), ParallelConfig(**parallel), world, CPU_ONLY)
    assert message in str(err.value)


def test_fp8_needs_an_fp8_gpu_even_with_transformer_engine():
    ampere = Accelerator(transformer_engine=True, cuda=True, fp8_gpu=False)
    with pytest.raises(ValueError, match=r"parallel.fp8='e4m3' needs a GPU with FP8 support"):
        validate_layout(tiny(), ParallelConfig(fp8="e4m3"), 1, ampere)
    assert validate_layout(tiny(), ParallelConfig(fp8="e4m3"), 1, HOPPER_WITH_TE) == 1
    cp = ParallelConfig(context_parallel_size=2)
    assert validate_layout(tiny(), cp, 4, HOPPER_WITH_TE) == 2


def test_this_machine_is_probed_when_no_accelerator_is_given():
    detected = Accelerator.detect()
    # the suite runs on the CPU (tests/conftest.py), also on a machine with a GPU
    assert detected.cuda is False and Accelerator.detect("cpu").cuda is False
    if not detected.transformer_engine:
        with pytest.raises(ValueError, match="needs Transformer Engine"):
            validate_layout(tiny(), ParallelConfig(fp8="e4m3"), 1)


# ------------------------------------------------------------------------ TransformerConfig


def test_transformer_config_conversion():
    from bapo_megatron.actor.megatron_config import to_transformer_config

    qwen = ModelConfig.from_hf_config(QWEN25_05B_STYLE)
    tc = to_transformer_config(
        qwen,
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
        use_cpu_initialization=True,
    )
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (24, 896, 4864)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (14, 2, 64)
    assert tc.add_qkv_bias is True and tc.add_bias_linear is False
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-6
    assert tc.gated_linear_unit is True and tc.activation_func is torch.nn.functional.silu
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
    assert tc.params_dtype is torch.float32 and tc.bf16 is False
    assert tc.tensor_model_parallel_size == 2 and tc.sequence_parallel is True
    assert tc.use_cpu_initialization is True and tc.fp8 is None

    llama = ModelConfig.from_hf_config(LLAMA_3_8B_STYLE, params_dtype="bfloat16")
    layout = ParallelConfig(
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        fp8="hybrid",
        fp8_recipe="tensorwise",
        fp8_amax_history_len=16,
        fp8_amax_compute_algo="max",
    )
    tc = to_transformer_config(llama, layout, use_cpu_initialization=False)
    assert (tc.num_query_groups, tc.add_qkv_bias, tc.layernorm_epsilon) == (8, False, 1e-5)
    assert (
        tc.params_dtype is torch.bfloat16
        and tc.pipeline_dtype is torch.bfloat16
        and tc.bf16 is True
    )
    assert (tc.pipeline_model_parallel_size, tc.virtual_pipeline_model_parallel_size) == (4, 2)
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_amax_history_len, tc.fp8_amax_compute_algo) == (
        "hybrid",
        "tensorwise",
        16,
        "max",
    )


def test_transformers5_rope_parameters_form():
    """transformers 5 writes the RoPE base inside rope_parameters; reading only the top-level
    key would silently give Qwen2 a base of 10000 instead of 1e6."""
    base = {k: v for k, v in QWEN25_05B_STYLE.items() if k != "rope_theta"}
    cfg = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert cfg.rope_theta == 1e6
    with pytest.raises(ValueError, match="rope_parameters.rope_type='yarn' is not supported"):
        ModelConfig.from_hf_config(
            {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}
        )
    with pytest.raises(ValueError, match="disagree"):
        ModelConfig.from_hf_config(
            {**base, "rope_theta": 1e4, "rope_parameters": {"rope_theta": 1e6}}
        )
    import transformers

    hf = transformers.AutoConfig.for_model(**cfg.to_hf_config()).to_dict()
    assert ModelConfig.from_hf_config(hf) == cfg  # what transformers itself writes reads back
