"""The layout planner's actor state of a mixture-of-experts model equals, byte for byte, what
Megatron allocates on each rank of a real 2-process run.

Two gloo workers build a tiny bf16 Qwen3-MoE actor (the first layer dense, the others 4 experts
each) at EP2 (data parallel 2 carved into expert parallel 2: dense gradients and optimizer state
over the data-parallel group, each rank the only copy of its experts) with and without the
distributed optimizer, and at DP2 with EP1 (every rank holds every expert, in the dense
buffers), take one optimizer step so that Adam's state exists, and measure their parameter
tensors, DDP gradient buffers (dense and expert-parallel) and optimizer state (fp32 main
parameters, ``exp_avg``, ``exp_avg_sq``). The planner (:func:`plan_layout`, every rank simulated
on the meta device under a fake process group) must give each rank the same weights, gradients
and optimizer bytes, and the same expert-parallel part.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker: pin thread pools before torch loads
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse

import torch.distributed as dist

from bapo_megatron.actor.actor import build_actor  # noqa: E402
from bapo_megatron.actor.optimizer import optimizer_step  # noqa: E402
from bapo_megatron.config import (  # noqa: E402
    ActorConfig,
    Config,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
)
from bapo_megatron.config.moe import MoeConfig  # noqa: E402
from bapo_megatron.distributed.context import ParallelContext  # noqa: E402
from bapo_megatron.distributed.layout import Accelerator  # noqa: E402
from bapo_megatron.planning.plan import plan_layout  # noqa: E402
from bapo_megatron.planning.shard_memory import is_expert_parallel  # noqa: E402
from tests.helpers import gloo_launch  # noqa: E402
from tests.helpers.actor_state import optimizer_state_bytes  # noqa: E402

MODEL = ModelConfig(
    model_type="qwen3_moe",
    num_layers=3,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=32,
    params_dtype="bfloat16",
    moe=MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=(0,)
    ),
)
LAYOUTS = {
    "ep2": (ParallelConfig(expert_model_parallel_size=2), False),
    "ep2-distributed-optimizer": (ParallelConfig(expert_model_parallel_size=2), True),
    "dp2-distributed-optimizer": (ParallelConfig(), True),
}
CPU = Accelerator(transformer_engine=False, cuda=False, fp8_gpu=False)
LAUNCH_TIMEOUT_S = 600.0


def measured_state(actor) -> dict[str, int]:
    """Bytes of the actor's parameters, gradient buffers and optimizer state, and the
    expert-parallel part of the first two."""
    params = [p for chunk in actor.chunks for p in chunk.module.parameters()]

    def buffer_bytes(name: str) -> int:
        return sum(
            b.grad_data.numel() * b.grad_data.element_size()
            for chunk in actor.chunks
            for b in getattr(chunk, name)
        )

    return {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": buffer_bytes("buffers") + buffer_bytes("expert_parallel_buffers"),
        "optimizer": optimizer_state_bytes(actor),
        "expert_weights": sum(
            p.numel() * p.element_size() for p in params if is_expert_parallel(p)
        ),
        "expert_gradients": buffer_bytes("expert_parallel_buffers"),
    }


def worker(args: argparse.Namespace) -> None:
    gloo_launch.join_group(args, timeout_s=300)
    results = {}
    for name, (layout, distributed) in LAYOUTS.items():
        context = ParallelContext.initialize(layout)
        actor = build_actor(
            MODEL, ActorConfig(), OptimizerConfig(use_distributed_optimizer=distributed), context
        )
        for chunk in actor.chunks:
            for p in chunk.module.parameters():
                p.main_grad.fill_(1e-3)
        assert not optimizer_step(actor.optimizer, actor.scheduler, 1.0).skipped
        results[name] = measured_state(actor)
        context.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


def test_planned_state_equals_the_built_moe_actor_on_every_rank(tmp_path):
    planned = {}
    for name, (layout, distributed) in LAYOUTS.items():
        config = Config(
            parallel=layout, optimizer=OptimizerConfig(use_distributed_optimizer=distributed)
        )
        plan = plan_layout(config, MODEL, 2, accelerator=CPU, all_ranks=True)
        assert not plan.problems, plan.problems
        planned[name] = plan.memory
    results = gloo_launch.launch(__file__, 2, tmp_path, [], LAUNCH_TIMEOUT_S)
    for rank, result in enumerate(results):
        for name in LAYOUTS:
            memory = planned[name][rank]
            assert memory.rank == rank
            got = {key: getattr(memory, key) for key in result[name]}
            assert got == result[name], (rank, name)
    ep2 = [r["ep2"] for r in results]
    # The experts are half the model's expert weights on each rank, in buffers of their own
    # (fp32 gradients: twice the bf16 weights); at EP1 they are in the dense buffers.
    assert ep2[0]["expert_weights"] == 2 * 2 * 4 // 2 * 3 * 32 * 24
    assert ep2[0]["expert_gradients"] == 2 * ep2[0]["expert_weights"]
    assert all(r["dp2-distributed-optimizer"]["expert_weights"] == 0 for r in results)
    # The distributed optimizer shards the dense state over the 2 ranks, not the experts'.
    for r in results:
        assert r["ep2-distributed-optimizer"]["optimizer"] < r["ep2"]["optimizer"]
        assert r["dp2-distributed-optimizer"]["optimizer"] < r["ep2"]["optimizer"]


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:]))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
