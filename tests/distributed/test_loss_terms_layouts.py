"""The loss's extra terms through the actor's train step at TP2 and at PP2 give the
single-process result: the entropy bonus (``loss.entropy_coef``, its entropy from
vocabulary-parallel logits at TP2) together with band-masked importance weights (some tokens
at weight 0, the others at their ratio, as `icepop` makes them), for 2 optimizer steps of a tiny
Qwen2-style model from the same initial weights. Compared: per-step loss, entropy bonus, policy
loss, grad norm, entropy, bounds, and every parameter after the steps."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker: pin thread pools before torch loads
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse
import dataclasses

import pytest
import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.model import (
    global_parameter_name,
    load_whole_model_weights,
    tensor_parallel_shard,
)
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.importance_weights import importance_weights
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
)
from bapo_megatron.distributed.context import ParallelContext
from tests.helpers import gloo_launch

MODEL = ModelConfig(
    model_type="qwen2",
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    max_position_embeddings=32,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
ACTOR = ActorConfig(micro_batch_size=2, temperature=0.9, seed=5)
OPTIMIZER = OptimizerConfig(lr=3e-3, weight_decay=0.0, clip_grad=1.0)
LOSS = LossConfig(entropy_coef=0.05)
PLAN = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
STEPS = 2
LAYOUTS = {
    "tp2": ParallelConfig(tensor_model_parallel_size=2),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
}
COMPARED = (
    "loss",
    "actor/entropy_bonus",
    "actor/policy_loss",
    "grad_norm",
    "entropy",
    "bapo/c_low",
    "bapo/c_high",
    "bapo/rho_after",
)
PARAM_TOLERANCE = 0.01 * OPTIMIZER.lr * STEPS  # Adam turns rounding into update-sized steps
LAUNCH_TIMEOUT_S = 300.0


def sequences(initial_logprobs_of) -> PolicyBatch:
    """6 sequences, old log-probs from the initial policy plus noise, importance weights of the
    `icepop` band [0.7, 1.4] between those and a noisier behaviour policy."""
    g = torch.Generator().manual_seed(20261201)
    n, length = 6, 14
    tokens = torch.randint(0, MODEL.vocab_size, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):
        mask[
            i,
            int(torch.randint(2, 5, (), generator=g)) : int(torch.randint(8, 15, (), generator=g)),
        ] = True
    logprobs = initial_logprobs_of(PolicyBatch(tokens=tokens, response_mask=mask))
    old = torch.where(mask, logprobs + 0.3 * torch.randn(n, length, generator=g), 0.0)
    behaviour = old + 0.4 * torch.randn(n, length, generator=g)
    weights = importance_weights("icepop", old, behaviour, mask, None, (0.7, 1.4)).weights
    assert 0 < int((mask & (weights == 0)).sum()) < int(mask.sum())
    return PolicyBatch(
        tokens=tokens,
        response_mask=mask,
        old_logprobs=old,
        advantages=torch.randn(n, generator=g),
        is_weights=weights,
    )


def train(context: ParallelContext, weights: dict, batch: PolicyBatch, loss: LossConfig) -> dict:
    actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
    load_whole_model_weights(actor.chunks, weights, context)
    metrics = [train_step(actor, batch, loss, PLAN) for _ in range(STEPS)]
    params = {}
    for chunk in actor.chunks:
        for name, param in chunk.module.named_parameters():
            params[global_parameter_name(chunk, name)] = (name, param)  # keeps its TP attributes
    return dict(metrics=metrics, params=params)


def worker(args: argparse.Namespace) -> None:
    gloo_launch.join_group(args, timeout_s=240)
    data = torch.load(args.data, weights_only=False)
    results = {}
    for name, layout in LAYOUTS.items():
        context = ParallelContext.initialize(layout)
        run = train(context, data["weights"], data["batch"], LOSS)
        worst = 0.0
        for global_name, (local_name, shard) in run["params"].items():
            key = (
                global_name if global_name in data["final"] else "embedding.word_embeddings.weight"
            )
            expected = tensor_parallel_shard(
                local_name, data["final"][key], shard, context.tp_rank, context.tp_size
            )
            worst = max(worst, float((shard.detach() - expected).abs().max()))
        results[name] = dict(metrics=run["metrics"], param_error=worst)
        context.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_entropy_bonus_and_masked_weights_match_the_single_process_run(tmp_path, single_process):
    context = single_process
    reference_actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
    weights = {
        global_parameter_name(c, n): p.detach().clone()
        for c in reference_actor.chunks
        for n, p in c.module.named_parameters()
    }

    def initial_logprobs(batch: PolicyBatch) -> torch.Tensor:
        return compute_logprobs(
            reference_actor.chunks, batch, context, batching=Batching(6), temperature=0.9
        )[0]

    batch = sequences(initial_logprobs)
    reference = train(context, weights, batch, LOSS)
    without = train(context, weights, batch, dataclasses.replace(LOSS, entropy_coef=0.0))
    for step, metrics in enumerate(reference["metrics"]):  # the bonus is there and matters
        assert metrics["actor/entropy_bonus"] > 0
        assert "actor/entropy_bonus" not in without["metrics"][step]
    assert reference["metrics"][0]["grad_norm"] != without["metrics"][0]["grad_norm"]
    final = {name: p.detach().clone() for name, (_, p) in reference["params"].items()}
    torch.save(dict(weights=weights, batch=batch, final=final), tmp_path / "data.pt")

    results = gloo_launch.launch(
        __file__, 2, tmp_path, ["--data", tmp_path / "data.pt"], LAUNCH_TIMEOUT_S
    )
    for rank, result in enumerate(results):
        for name in LAYOUTS:
            got = result[name]
            for step, (g, w) in enumerate(zip(got["metrics"], reference["metrics"])):
                for key in COMPARED:
                    assert g[key] == pytest.approx(w[key], rel=2e-5, abs=2e-6), (
                        f"rank {rank} {name} step {step} {key}"
                    )
            assert got["param_error"] < PARAM_TOLERANCE, f"rank {rank} {name}"


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], data=str))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
