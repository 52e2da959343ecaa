"""The layout planner's mixture-of-experts accounting on a tiny Qwen3-MoE, against counts made by
hand here: which layers of a stage are MoE layers, the expert and router parameters of a rank,
the tensors an MoE layer saves, the dispatcher's buffers, and a whole fake world of simulated
ranks (every rank's meta shard holds the experts the analytic count says, the shards add up to
the model, the expert state is sharded over the expert data-parallel group)."""

from __future__ import annotations

import dataclasses

import pytest

from bapo_megatron.config import Config, ModelConfig, ParallelConfig, RolloutConfig
from bapo_megatron.config.actor import OptimizerConfig
from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.distributed.layout import Accelerator
from bapo_megatron.planning.activations import ActivationShape, layer_bytes, stage_bytes
from bapo_megatron.planning.moe_memory import (
    dispatcher_bytes,
    expert_parameters,
    expert_token_copies,
    moe_mlp_bytes,
    router_parameters,
    stage_layers,
    stage_moe_layers,
)
from bapo_megatron.planning.plan import plan_layout
from bapo_megatron.planning.simulated_rank import expert_coordinates, expert_rank
from tests.helpers.published_configs import parameter_count

H, F, E, K = 16, 12, 8, 2  # hidden, expert width, experts, top-k
MODEL = ModelConfig(
    model_type="qwen3_moe",
    num_layers=6,
    hidden_size=H,
    ffn_hidden_size=40,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=64,
    params_dtype="bfloat16",
    # MoE layers: every second one (1, 3, 5) but 5, which stays dense.
    moe=MoeConfig(
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        decoder_sparse_step=2,
        mlp_only_layers=(5,),
    ),
)
CPU = Accelerator(transformer_engine=False, cuda=False, fp8_gpu=False)


def layout(**fields) -> ParallelConfig:
    return ParallelConfig(**fields)


def test_stage_layers_and_their_moe_layers():
    pp2 = layout(pipeline_model_parallel_size=2)
    assert stage_layers(MODEL, pp2, 0) == [0, 1, 2]
    assert stage_layers(MODEL, pp2, 1) == [3, 4, 5]
    assert [stage_moe_layers(MODEL, pp2, p) for p in (0, 1)] == [1, 1]  # layers 1 and 3
    # Interleaved: 6 chunks of one layer, chunk v of stage p is layer 2v + p.
    vpp = layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3)
    assert stage_layers(MODEL, vpp, 0) == [0, 2, 4]
    assert stage_layers(MODEL, vpp, 1) == [1, 3, 5]
    assert [stage_moe_layers(MODEL, vpp, p) for p in (0, 1)] == [0, 2]
    dense = dataclasses.replace(MODEL, model_type="qwen3", moe=None)
    assert stage_moe_layers(dense, pp2, 0) == expert_parameters(dense, pp2, 0) == 0


def test_expert_and_router_parameters_by_hand():
    one_stage = layout()
    # 2 MoE layers x 8 experts x (gate [12, 16] + up [12, 16] + down [16, 12])
    assert expert_parameters(MODEL, one_stage, 0) == 2 * 8 * (12 * 16 + 12 * 16 + 16 * 12)
    split = layout(expert_model_parallel_size=4, expert_tensor_parallel_size=2)
    # 2 experts per rank, each matrix halved
    assert expert_parameters(MODEL, split, 0) == 2 * 2 * (6 * 16 + 6 * 16 + 16 * 6)
    assert router_parameters(MODEL, split, 0) == 2 * 8 * 16  # whole on every rank


def saved_moe_tensors(tokens: int, etp: int = 1, load: float = 1.0) -> float:
    """The tensors an MoE layer saves, listed one by one (bytes, float64): bf16 activations."""
    copies = tokens * K * etp * load
    width = F / etp
    tensors = [
        (tokens * E, 4),  # router logits, fp32
        (tokens * E, 4),  # router probabilities over all experts, fp32
        (copies * H, 2),  # the experts' input (the sorted copies)
        (copies * 2 * width, 2),  # fc1 output (gate and up)
        (copies * width, 2),  # SwiGLU output (flash: fused, one tensor)
        (copies * width, 2),  # scaled by the routing probability: fc2's input
        (copies, 4),  # each copy's routing probability, fp32
        (copies, 8),  # its int64 position in the permutation
    ]
    return sum(float(n) * size for n, size in tensors)


@pytest.mark.parametrize("tokens,etp,load", [(100, 1, 1.0), (37, 2, 1.0), (64, 1, 1.5)])
def test_moe_layer_saves_what_is_listed_by_hand(tokens, etp, load):
    parallel = layout(expert_tensor_parallel_size=etp)
    got = moe_mlp_bytes(tokens, MODEL, parallel, 2, swiglu_tensors=3, expert_load=load)
    assert got == saved_moe_tensors(tokens, etp, load)


def test_dispatcher_buffers_by_hand():
    tokens = 50
    alltoall = layout(expert_model_parallel_size=4)
    # sent: 50 x 2 copies, received as many (balanced), each h bf16 + an fp32 probability
    assert dispatcher_bytes(tokens, MODEL, alltoall, 2) == 2 * 100 * (16 * 2 + 4)
    with_etp = layout(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    # and the received copies gathered over the 2 expert-TP ranks
    assert dispatcher_bytes(tokens, MODEL, with_etp, 2) == (100 + 100 + 200) * (16 * 2 + 4)
    allgather = layout(expert_model_parallel_size=4, moe_token_dispatcher="allgather")
    # every token of the 4 EP ranks: h bf16, fp32 probabilities and a bool map over 8 experts
    assert dispatcher_bytes(tokens, MODEL, allgather, 2) == 200 * (16 * 2 + 8 * 4 + 8)
    wide = dataclasses.replace(MODEL, hidden_size=64)  # the fp32 combine is then the larger
    assert dispatcher_bytes(tokens, wide, allgather, 2) == 200 * 64 * 4
    assert expert_token_copies(tokens, MODEL, alltoall, expert_load=2.0) == 200


def test_recomputation_keeps_layer_inputs_and_one_layer():
    shape = ActivationShape(micro_batch_size=2, sequence_length=32, micro_batches=8)
    pp2 = layout(pipeline_model_parallel_size=2)
    kept = stage_bytes(MODEL, pp2, shape, 0, 3)
    recomputed = stage_bytes(MODEL, pp2, shape, 0, 3, recompute=True)
    tokens = 2 * 32
    moe_layer = layer_bytes(MODEL, pp2, shape) - 3 * tokens * 40 * 2
    moe_layer += int(saved_moe_tensors(tokens))
    # stage 0 of 2 holds 2 micro-batches: each keeps 3 layer inputs and the embedding output;
    # the backward pass recomputes one layer (the MoE one is the larger here).
    assert moe_layer > layer_bytes(MODEL, pp2, shape)
    assert recomputed == 2 * (3 + 1) * tokens * H * 2 + moe_layer
    assert kept == 2 * (2 * layer_bytes(MODEL, pp2, shape) + moe_layer + tokens * H * 2)


@pytest.mark.parametrize(
    "fields,world,edp",
    [
        (
            dict(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                pipeline_model_parallel_size=2,
                expert_model_parallel_size=4,
            ),
            16,
            2,
        ),
        (
            dict(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                expert_model_parallel_size=2,
                expert_tensor_parallel_size=2,
            ),
            8,
            2,
        ),
    ],
    ids=["tp2-pp2-ep4", "tp2-ep2-etp2"],
)
def test_every_simulated_rank_holds_the_counted_experts(fields, world, edp):
    parallel = layout(**fields)
    config = Config(parallel=parallel, optimizer=OptimizerConfig(use_distributed_optimizer=True))
    plan = plan_layout(config, MODEL, world, accelerator=CPU, all_ranks=True)
    assert not plan.problems, plan.problems
    assert plan.simulated_ranks == list(range(world))
    pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size
    moe_layers_per_stage = 2 // pp
    per_rank = moe_layers_per_stage * (E // ep) * 3 * H * F // etp
    assert plan.expert_parameters_per_rank == dict.fromkeys(range(world), per_rank)
    # each expert of the model is on expert-data-parallel-size ranks
    assert plan.expert_data_parallel_size == edp
    assert sum(plan.expert_parameters_per_rank.values()) == edp * 2 * E * 3 * H * F
    assert plan.shard_parameters == plan.model_parameters == parameter_count(MODEL)
    assert plan.export.complete
    for memory in plan.memory:
        assert memory.expert_weights == per_rank * 2  # bf16
        # one fp32 buffer, padded for the distributed optimizer (byte-exact against a built
        # actor: tests/distributed/test_moe_planner_state.py)
        assert per_rank * 4 <= memory.expert_gradients < per_rank * 4 * 1.25
        coordinates = (memory.etp_rank, memory.ep_rank, memory.edp_rank, memory.pp_rank)
        assert expert_rank(parallel, world, *coordinates) == memory.rank
        # the distributed optimizer shards the experts' state (fp32 main + 2 moments) over edp
        assert memory.expert_optimizer == pytest.approx(per_rank * 12 / edp, rel=0.1)


def test_expert_rank_order_round_trips():
    parallel = layout(
        pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2
    )
    world = 16
    for rank in range(world):
        etp, ep, edp = expert_coordinates(parallel, world, rank)
        assert expert_rank(parallel, world, etp, ep, edp, rank // 8) == rank
    assert expert_coordinates(parallel, world, 13) == (1, 0, 1)  # stage 1, local rank 5


def test_engines_that_would_share_gpus_are_refused():
    config = Config(
        parallel=layout(tensor_model_parallel_size=2, sequence_parallel=True),
        rollout=RolloutConfig(engine="sglang", engine_tensor_parallel_size=4),
    )
    plan = plan_layout(config, MODEL, 8, accelerator=CPU)
    assert any(
        "engine_tensor_parallel_size=4" in p and "engines would share GPUs" in p
        for p in plan.problems
    ), plan.problems


def test_engines_that_would_span_past_their_node_are_refused():
    """Replicas of 4 ranks on nodes of 6 GPUs: the second replica's first rank is GPU 4 of its
    node, so an engine over 4 GPUs from there would need GPUs 4..7; on nodes of 8 it fits."""
    config = Config(
        parallel=layout(tensor_model_parallel_size=4, sequence_parallel=True),
        rollout=RolloutConfig(engine="vllm", engine_tensor_parallel_size=4),
    )
    model = dataclasses.replace(MODEL, num_query_groups=4)
    spill = "would span GPUs past its node's"
    fits = plan_layout(config, model, 8, accelerator=CPU, gpus_per_node=8)
    assert not any(spill in p for p in fits.problems), fits.problems
    plan = plan_layout(config, model, 12, accelerator=CPU, gpus_per_node=6)
    assert any(
        "engine_tensor_parallel_size=4" in p and "first rank is 4" in p and spill in p
        for p in plan.problems
    ), plan.problems
