"""The Qwen3-MoE family's configuration: its config.json read into ``model.moe`` and written
back, the variants it cannot represent refused naming the file and field, Megatron's MoE fields
from the one conversion, and the expert-parallel layout checks."""

from __future__ import annotations

import json

import pytest

from bapo_megatron.config import ModelConfig, ParallelConfig, check_training
from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.distributed.layout import Accelerator, validate_layout
from tests.helpers.published_configs import config_path, published_config

CPU = Accelerator(transformer_engine=False, cuda=False, fp8_gpu=False)


def tiny_moe(**moe_changes) -> ModelConfig:
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    moe.update(moe_changes)
    return ModelConfig(
        model_type="qwen3_moe",
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=32,
        moe=MoeConfig(**moe),
    )


def write_config(tmp_path, content: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    return path


# ------------------------------------------------------------------------ config.json


def test_qwen3_30b_a3b_reads_into_the_moe_section():
    model = ModelConfig.from_hf_config(config_path("Qwen3-30B-A3B"))
    assert model.model_type == "qwen3_moe" and model.is_moe and model.qk_layernorm
    assert model.moe == MoeConfig(
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
        router_aux_loss_coef=0.001,
    )
    assert model.head_dim == 128 and model.num_query_groups == 4
    assert model.moe.num_moe_layers(model.num_layers) == 48


def test_config_json_round_trip_keeps_the_experts():
    hf = published_config("Qwen3-235B-A22B")
    model = ModelConfig.from_hf_config(hf)
    written = model.to_hf_config()
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "router_aux_loss_coef",
    ):
        assert written[key] == hf[key], key
    assert ModelConfig.from_hf_config(written) == model


def test_sparse_layers_follow_the_hf_rule():
    # transformers' Qwen3MoeDecoderLayer: experts when (i + 1) % step == 0 and i not in
    # mlp_only_layers
    moe = MoeConfig(
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=8,
        decoder_sparse_step=2,
        mlp_only_layers=(3,),
    )
    assert moe.moe_layer_pattern(6) == [False, True, False, False, False, True]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size=512 is not"),
        ({"n_shared_experts": 1}, "n_shared_experts=1 is not supported (shared experts"),
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
        ({"n_group": 8}, "n_group=8 is not supported (grouped"),
        ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5 is not supported"),
        ({"num_experts_per_tok": 200}, "model.moe.num_experts_per_tok (200) must be at most"),
        ({"mlp_only_layers": [48]}, "model.moe.mlp_only_layers: layers [48] do not exist"),
        ({"decoder_sparse_step": 0}, "model.moe.decoder_sparse_step must be a positive"),
        ({"router_aux_loss_coef": -1.0}, "model.moe.router_aux_loss_coef must be a finite"),
        ({"num_experts": None}, "required field 'num_experts' is missing"),
        ({"mlp_only_layers": list(range(48))}, "leave no MoE layer"),
    ],
)
def test_unsupported_moe_variants_are_refused_naming_file_and_field(tmp_path, change, message):
    path = write_config(tmp_path, {**published_config("Qwen3-30B-A3B"), **change})
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_moe_section_belongs_to_moe_families_only():
    with pytest.raises(ValueError, match="model.moe is required for model_type 'qwen3_moe'"):
        ModelConfig(
            model_type="qwen3_moe",
            num_layers=2,
            hidden_size=32,
            ffn_hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=64,
        )
    with pytest.raises(ValueError, match="model.moe is set, but model_type 'qwen3' is dense"):
        ModelConfig(
            model_type="qwen3",
            num_layers=2,
            hidden_size=32,
            ffn_hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=64,
            moe=MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
        )


# ------------------------------------------------------------------------ Megatron fields


def test_megatron_moe_fields():
    from bapo_megatron.actor.megatron_config import moe_fields

    model = tiny_moe(mlp_only_layers=(0,), norm_topk_prob=True)
    fields = moe_fields(model, ParallelConfig(expert_model_parallel_size=2))
    assert fields["num_moe_experts"] == 4
    assert fields["moe_ffn_hidden_size"] == 16
    assert fields["moe_router_topk"] == 2
    assert fields["moe_layer_freq"] == [0, 1, 1, 1]
    assert fields["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top-k
    assert fields["moe_router_load_balancing_type"] == "none"  # the actor adds its own
    assert fields["expert_model_parallel_size"] == 2
    assert fields["expert_tensor_parallel_size"] == 1
    assert fields["moe_token_dispatcher_type"] == "alltoall"
    assert moe_fields(tiny_moe(norm_topk_prob=False), ParallelConfig())["moe_router_pre_softmax"]
    dense = ModelConfig.from_hf_config(config_path("Qwen3-32B"))
    assert moe_fields(dense, ParallelConfig()) == {}


# ------------------------------------------------------------------------ layouts


def test_parallel_config_expert_fields_are_checked():
    with pytest.raises(ValueError, match="parallel.expert_model_parallel_size must be a positive"):
        ParallelConfig(expert_model_parallel_size=0)
    with pytest.raises(ValueError, match="parallel.moe_token_dispatcher must be"):
        ParallelConfig(moe_token_dispatcher="flex")
    assert (
        ParallelConfig(
            expert_model_parallel_size=4, expert_tensor_parallel_size=2
        ).expert_parallel_size
        == 8
    )


@pytest.mark.parametrize(
    ("parallel", "world", "message"),
    [
        (ParallelConfig(expert_model_parallel_size=3), 3, "model.moe.num_experts (4) is not"),
        (
            ParallelConfig(expert_tensor_parallel_size=32),
            32,
            "model.moe.moe_intermediate_size (16) is not divisible",
        ),
        (
            ParallelConfig(expert_model_parallel_size=4, pipeline_model_parallel_size=2),
            4,
            "the 2 ranks of a pipeline stage (world size 4 / pipeline 2) are not divisible",
        ),
        (
            ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2),
            2,
            "needs parallel.sequence_parallel=true",
        ),
    ],
)
def test_expert_layouts_that_cannot_work_are_refused(parallel, world, message):
    with pytest.raises(ValueError) as err:
        validate_layout(tiny_moe(), parallel, world, CPU)
    assert message in str(err.value)


def test_expert_layouts_that_work():
    model = tiny_moe()
    # EP carved out of data parallel; with TP2 + SP out of the tensor-parallel ranks
    assert validate_layout(model, ParallelConfig(expert_model_parallel_size=2), 2, CPU) == 2
    tp_sp_ep = ParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2
    )
    assert validate_layout(model, tp_sp_ep, 2, CPU) == 1
    assert validate_layout(model, ParallelConfig(expert_model_parallel_size=4), 8, CPU) == 8


def test_expert_parallel_needs_an_moe_model():
    dense = ModelConfig.from_hf_config(config_path("Qwen3-8B"))
    with pytest.raises(ValueError, match="parallel.expert_model_parallel_size=2 needs a mixture"):
        validate_layout(dense, ParallelConfig(expert_model_parallel_size=2), 2, CPU)


# ------------------------------------------------------------------------ run checks

TRAINABLE_DENSE = [
    "data.synthetic_task=count_to",
    "model.model_type=qwen3",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.vocab_size=128",
]
MOE = [
    "model.model_type=qwen3_moe",
    "model.moe.num_experts=4",
    "model.moe.num_experts_per_tok=2",
    "model.moe.moe_intermediate_size=16",
]


def test_moe_section_and_expert_parallel_load_from_dotted_overrides():
    from bapo_megatron.config import load_config

    cfg = load_config(
        None,
        [
            *TRAINABLE_DENSE,
            *MOE,
            "model.moe.mlp_only_layers=[0]",
            "parallel.expert_model_parallel_size=2",
        ],
    )
    assert cfg.model.moe.mlp_only_layers == (0,)
    assert cfg.parallel.expert_model_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.routing_replay=trainer"],
            "algorithm.routing_replay='trainer' replays expert routes, but model.model_type "
            "'qwen3' has no experts",
        ),
        (
            [*MOE, "algorithm.routing_replay=trainer"],
            "algorithm.routing_replay='trainer' replays the routes of the actor's old-log-prob "
            "pass, which needs algorithm.old_logprobs=recompute",
        ),
        (
            [*MOE, "parallel.expert_tensor_parallel_size=2"],
            "parallel.expert_tensor_parallel_size=2 must divide "
            "parallel.tensor_model_parallel_size x parallel.context_parallel_size (= 1) in a "
            "colocated run",
        ),
    ],
)
def test_routing_replay_and_moe_runs_are_checked(overrides, message):
    from bapo_megatron.config import load_config

    cfg = load_config(None, [*TRAINABLE_DENSE, *overrides])
    with pytest.raises(ValueError) as raised:
        check_training(cfg)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            [
                "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true",
                "parallel.expert_tensor_parallel_size=2",
            ],
            id="colocated-etp2-tp2",
        ),
        pytest.param(
            [
                "parallel.expert_tensor_parallel_size=2",
                "rollout.placement=disaggregated",
                "rollout.engine_ranks=1",
            ],
            id="disaggregated-etp2",
        ),
        pytest.param(
            [
                "parallel.expert_model_parallel_size=2",
                "rollout.placement=disaggregated",
                "rollout.engine_ranks=1",
            ],
            id="disaggregated-ep2",
        ),
    ],
)
def test_expert_layouts_the_weight_sync_serves_are_accepted(overrides):
    from bapo_megatron.config import load_config

    cfg = load_config(None, [*TRAINABLE_DENSE, *MOE, *overrides])
    check_training(cfg)


def test_routing_replay_values_are_checked():
    from bapo_megatron.config import load_config

    with pytest.raises(ValueError, match="algorithm.routing_replay: expected one of"):
        load_config(None, ["algorithm.routing_replay=R3"])
    check_training(load_config(None, TRAINABLE_DENSE))  # none: the dense run as before
    for replay in ("none", "rollout"):
        check_training(
            load_config(None, [*TRAINABLE_DENSE, *MOE, f"algorithm.routing_replay={replay}"])
        )
    # every engine loads expert weights and returns routes (vLLM, SGLang: when asked)
    for engine in ("vllm", "vllm-server", "sglang", "sglang-server"):
        check_training(
            load_config(
                None,
                [
                    *TRAINABLE_DENSE,
                    *MOE,
                    "algorithm.routing_replay=rollout",
                    f"rollout.engine={engine}",
                    "rollout.server_urls=[http://localhost:1]",
                ],
            )
        )
    check_training(
        load_config(
            None,
            [
                *TRAINABLE_DENSE,
                *MOE,
                "algorithm.routing_replay=trainer",
                "algorithm.old_logprobs=recompute",
            ],
        )
    )


def test_the_layout_planner_plans_moe_models():
    from bapo_megatron.config import load_config
    from bapo_megatron.planning.plan import plan_layout

    cfg = load_config(None, [*TRAINABLE_DENSE, *MOE])
    plan = plan_layout(cfg, cfg.model, 1)
    assert not plan.problems
    moe_layers = sum(cfg.model.moe.moe_layer_pattern(cfg.model.num_layers))
    experts = moe_layers * 4 * 3 * cfg.model.hidden_size * 16
    assert plan.expert_parameters_per_rank == {0: experts}
    assert plan.shard_parameters == plan.model_parameters
    # one process: the experts are in the dense buffers (Megatron's DDP without EP)
    assert plan.memory[0].expert_weights == 0 and plan.memory[0].dispatcher > 0
