"""The mixture-of-experts actor's train step gives the single-process result at every expert
layout, load-balancing term included.

A tiny Qwen3-MoE (4 layers, the first dense, the others 4 experts with top-2 routing, q/k norms,
untied embeddings) is trained for 3 optimizer steps on the same 8 sequences in one process, and
in 2 gloo workers at

- EP2 (expert parallel carved out of data parallel 2), with the alltoall and with the allgather
  token dispatcher, and with Megatron's distributed optimizer;
- DP2 with EP1 (every rank holds every expert: expert gradients are summed over the expert
  data-parallel group), also with the distributed optimizer;
- TP2 with sequence parallelism and EP2 (attention split over the ranks, experts divided);
- TP2 with sequence parallelism and expert tensor parallel 2 (each expert split over the ranks);
- PP2 (the dense layer and one MoE layer per stage),

all from the same initial weights, with granularity `step` and one sequence per micro-batch, so
that every run's micro-batches hold the same sequences and the load-balancing term (weighted by
each micro-batch's share of the step's tokens) is the same sum. Compared: log-probs of the
initial policy, per-step loss, grad norm, entropy, bounds, rho, the aux term and every
parameter after the 3 steps. The term is large enough to matter: the reference run without it
ends with different router weights.

Routing replay at the same layouts: the routes each layout records for the initial policy equal
the one-process ones (sequence-parallel slices and pipeline stages merged back), and training
with given routes (random experts, the last token of each sequence missing) equals the
one-process run with those routes, also at PP2 with activation recompute, where the 1F1B
schedule runs two forwards before the first backward, so the recompute must take its routes
from Megatron's first-in-first-out queue.

Packed rows (``actor.pack_sequences``, one sequence per row, so that the aux term sums the same
micro-batches) give the same training runs at EP2 and at TP2 with sequence parallelism x EP2,
without and with replayed routes (the routes travel with their tokens into the packed row and
are split over the sequence-parallel ranks), and record the same routes at every layout.
"""

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

from bapo_megatron.actor.actor import build_actor  # noqa: E402
from bapo_megatron.actor.batch import PolicyBatch  # noqa: E402
from bapo_megatron.actor.logprobs import (  # noqa: E402
    compute_logprobs,
    compute_logprobs_and_routes,
)
from bapo_megatron.actor.microbatches import Batching  # noqa: E402
from bapo_megatron.actor.model import load_whole_model_weights  # noqa: E402
from bapo_megatron.config import ActorConfig, ModelConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from bapo_megatron.config.moe import MoeConfig  # noqa: E402
from bapo_megatron.distributed.context import ParallelContext  # noqa: E402
from tests.helpers import gloo_launch, layout_training  # noqa: E402
from tests.helpers.layout_training import (  # noqa: E402
    COMPARED,
    LAUNCH_TIMEOUT_S,
    NUM_SEQUENCES,
    OPTIMIZER,
    PARAM_TOLERANCE,
    run_result,
    whole_weights,
)

AUX_COEF = 0.05
MODEL = ModelConfig(
    model_type="qwen3_moe",
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=48,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=32,
    rope_theta=1e6,
    moe=MoeConfig(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=(0,),
        router_aux_loss_coef=AUX_COEF,
    ),
)
ACTOR = ActorConfig(micro_batch_size=1, temperature=0.8, seed=5)
DISTRIBUTED_OPTIMIZER = dataclasses.replace(OPTIMIZER, use_distributed_optimizer=True)
SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {
    "ep2": (ParallelConfig(expert_model_parallel_size=2), OPTIMIZER),
    "ep2-allgather": (
        ParallelConfig(expert_model_parallel_size=2, moe_token_dispatcher="allgather"),
        OPTIMIZER,
    ),
    "ep2-distributed-optimizer": (
        ParallelConfig(expert_model_parallel_size=2),
        DISTRIBUTED_OPTIMIZER,
    ),
    "dp2": (ParallelConfig(), OPTIMIZER),
    "dp2-distributed-optimizer": (ParallelConfig(), DISTRIBUTED_OPTIMIZER),
    "tp2-sp-ep2": (ParallelConfig(**SP, expert_model_parallel_size=2), OPTIMIZER),
    "tp2-sp-etp2": (ParallelConfig(**SP, expert_tensor_parallel_size=2), OPTIMIZER),
    "pp2": (ParallelConfig(pipeline_model_parallel_size=2), OPTIMIZER),
}
PACKED_LAYOUTS = ("ep2", "tp2-sp-ep2")
REPLAY_LAYOUTS = {
    "ep2": LAYOUTS["ep2"][0],
    "tp2-sp-ep2": LAYOUTS["tp2-sp-ep2"][0],
    "tp2-sp-etp2": LAYOUTS["tp2-sp-etp2"][0],
    "pp2": LAYOUTS["pp2"][0],
    "pp2-recompute": LAYOUTS["pp2"][0],
}
MOE_COMPARED = (*COMPARED, "moe/aux_loss", "moe/load_balancing_loss")


def sequences(initial_logprobs_of) -> PolicyBatch:
    # mostly negative advantages: the search moves
    return layout_training.sequences(
        initial_logprobs_of, MODEL.vocab_size, seed=20261126, advantage_shift=-0.8
    )


def train(
    context: ParallelContext,
    weights: dict[str, torch.Tensor],
    batch: PolicyBatch,
    optimizer: OptimizerConfig = OPTIMIZER,
    model: ModelConfig = MODEL,
    actor_config: ActorConfig = ACTOR,
) -> dict:
    """:func:`layout_training.train` at granularity `step`."""
    return layout_training.train(
        model, actor_config, context, weights, batch, "step", optimizer=optimizer
    )


def _assert_metrics_match(got: list[dict], want: list[dict], what: str) -> None:
    layout_training.assert_metrics_match(got, want, what, MOE_COMPARED)


# ------------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> None:
    gloo_launch.join_group(args, timeout_s=300)
    data = torch.load(args.data, weights_only=False)
    weights, batch, final = data["weights"], data["batch"], data["final_weights"]
    routes, final_replay = data["routes"], data["final_replay_weights"]
    results: dict[str, object] = {}
    for layout_name, (layout, optimizer) in LAYOUTS.items():
        context = ParallelContext.initialize(layout)
        per_rank = NUM_SEQUENCES // context.dp_size
        rows = slice(context.dp_rank * per_rank, (context.dp_rank + 1) * per_rank)
        local = batch.select(rows)
        run = train(context, weights, local, optimizer)
        actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
        load_whole_model_weights(actor.chunks, weights, context)
        logprobs, _ = compute_logprobs(
            actor.chunks, local, context, batching=Batching(2), temperature=ACTOR.temperature
        )
        _, recorded = compute_logprobs_and_routes(
            actor.chunks,
            local,
            context,
            actor.routing_replay,
            batching=Batching(2),
            temperature=ACTOR.temperature,
        )
        _, packed_recorded = compute_logprobs_and_routes(
            actor.chunks,
            local,
            context,
            actor.routing_replay,
            batching=Batching(2, pack=True),
            temperature=ACTOR.temperature,
        )
        replay_runs = {}
        if layout_name in PACKED_LAYOUTS:
            packed = dataclasses.replace(ACTOR, pack_sequences=True)
            for name, given, want in (
                ("packed", local, final),
                ("packed replay", dataclasses.replace(local, routes=routes[rows]), final_replay),
            ):
                run_packed = train(context, weights, given, actor_config=packed)
                replay_runs[name] = run_result(run_packed, want, context)
        for replay_name, replay_layout in REPLAY_LAYOUTS.items():
            if replay_layout != layout or layout_name not in REPLAY_LAYOUTS:
                continue
            actor_config = dataclasses.replace(
                ACTOR, recompute_activations=replay_name.endswith("recompute")
            )
            replayed = train(
                context,
                weights,
                dataclasses.replace(local, routes=routes[rows]),
                actor_config=actor_config,
            )
            replay_runs[replay_name] = run_result(replayed, final_replay, context)
        results[layout_name] = dict(
            recorded=recorded,
            packed_recorded=packed_recorded,
            replay_runs=replay_runs,
            **run_result(run, final, context),
            experts_here=sorted({n.split(".")[6] for n in run["params"] if ".local_experts." in n}),
            logprobs=logprobs,
            rows=rows,
            ranks=(context.tp_rank, context.pp_rank, context.dp_rank, context.ep_rank),
        )
        context.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


# ------------------------------------------------------------------------ test


@pytest.mark.multiprocess
def test_moe_layouts_match_the_single_process_run(tmp_path, single_process):
    context = single_process
    reference_actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
    weights = whole_weights(reference_actor)

    def initial_logprobs(batch: PolicyBatch) -> torch.Tensor:
        return compute_logprobs(
            reference_actor.chunks, batch, context, batching=Batching(3), temperature=0.8
        )[0]

    batch = sequences(initial_logprobs)
    ref_logprobs = initial_logprobs(batch)
    _, ref_routes = compute_logprobs_and_routes(
        reference_actor.chunks,
        batch,
        context,
        reference_actor.routing_replay,
        batching=Batching(2),
        temperature=ACTOR.temperature,
    )
    # replayed routes: random distinct experts, none for the last token of each sequence
    g = torch.Generator().manual_seed(99)
    routes = (
        torch.rand(*ref_routes.shape[:3], MODEL.moe.num_experts, generator=g)
        .topk(MODEL.moe.num_experts_per_tok, dim=-1)
        .indices
    )
    last = batch.response_mask.long().cumsum(1).argmax(1)
    routes[torch.arange(NUM_SEQUENCES), last] = -1
    replay_reference = train(context, weights, dataclasses.replace(batch, routes=routes))
    final_replay = layout_training.final_weights(replay_reference)
    reference = train(context, weights, batch)
    final = layout_training.final_weights(reference)
    # The term matters: without it the routers end elsewhere, and it is reported.
    no_aux = dataclasses.replace(MODEL, moe=dataclasses.replace(MODEL.moe, router_aux_loss_coef=0))
    without = train(context, weights, batch, model=no_aux)
    router = "decoder.layers.1.mlp.router.weight"
    moved = (final[router] - without["params"][router][1].detach()).abs().max()
    # (measured: 0.017, so a layout that dropped the term would fail the parameter comparison)
    assert moved > 10 * PARAM_TOLERANCE
    assert all(m["moe/aux_loss"] > 0 for m in reference["metrics"])
    assert all(m["moe/aux_loss"] == 0 for m in without["metrics"])
    assert any(m["bapo/search_steps"] > 0 for m in reference["metrics"])
    torch.save(
        dict(
            weights=weights,
            batch=batch,
            final_weights=final,
            routes=routes,
            final_replay_weights=final_replay,
        ),
        tmp_path / "data.pt",
    )

    positions = torch.arange(batch.tokens.shape[1])
    kept_tokens = positions[None] <= last[:, None]  # what a packed row keeps
    results = gloo_launch.launch(
        __file__, 2, tmp_path, ["--data", tmp_path / "data.pt"], LAUNCH_TIMEOUT_S
    )
    errors = {}
    for rank, result in enumerate(results):
        for layout_name in LAYOUTS:
            got = result[layout_name]
            what = f"rank {rank} {layout_name} (tp, pp, dp, ep) = {got['ranks']}"
            torch.testing.assert_close(
                got["logprobs"], ref_logprobs[got["rows"]], rtol=1e-5, atol=1e-5, msg=what
            )
            _assert_metrics_match(got["metrics"], reference["metrics"], what)
            errors[what] = got["param_error"]
            assert torch.equal(got["recorded"], ref_routes[got["rows"]]), what + " recorded"
            # packed rows route every token up to its sequence's last response token alone
            kept = kept_tokens[got["rows"]]
            want = torch.where(kept[..., None, None], ref_routes[got["rows"]], -1)
            assert torch.equal(got["packed_recorded"], want), what + " packed recorded"
            for replay_name, run in got["replay_runs"].items():
                want = reference if replay_name == "packed" else replay_reference
                _assert_metrics_match(
                    run["metrics"], want["metrics"], f"{what} replay {replay_name}"
                )
                errors[f"{what} replay {replay_name}"] = run["param_error"]
    assert set(results[0]["pp2"]["replay_runs"]) == {"pp2", "pp2-recompute"}
    # expert parallel: each rank holds its half of the experts, numbered globally
    assert results[0]["ep2"]["experts_here"] == ["0", "1"]
    assert results[1]["ep2"]["experts_here"] == ["2", "3"]
    assert results[1]["dp2"]["experts_here"] == ["0", "1", "2", "3"]
    worst = max(errors, key=errors.get)
    assert errors[worst] < PARAM_TOLERANCE, f"{worst}: parameters differ by {errors[worst]:.3g}"


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], data=str))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
