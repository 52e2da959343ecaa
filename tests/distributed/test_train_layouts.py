"""The actor's train step and log-prob pass give the single-process result at every layout.

A tiny Qwen2-style model (4 layers, tied embeddings, q/k/v bias) is trained for 3 optimizer steps
on the same 8 sequences (old log-probs from the initial policy plus noise, so ratios spread and
the search moves) in one process at TP1/PP1, and in 4 gloo workers at TP2/PP2, TP2/DP2, PP2/DP2,
TP2 with sequence parallelism x DP2, and PP2 x VPP2 x DP2, all from the same initial weights.
Compared: log-probs and entropy of the initial policy, per-step loss, grad norm, entropy, bounds
and rho, and every parameter after the 3 steps, for both granularities; at TP2/DP2 also with
Megatron's distributed optimizer.

Packed rows (``actor.pack_sequences``) give the same results: the log-probs and entropy at every
layout, granularity `step` with a token budget (which regroups the sequences and, over DP2,
balances them between the ranks) at TP2 with sequence parallelism x DP2 and at PP2 x DP2, and
granularity `microbatch` packed by count (the padded run's micro-batches) at TP2 x PP2.

With data parallelism, micro-batch i of the step is the union of micro-batch i of every rank;
the one-process reference runs the same unions (sequences interleaved, micro-batches dp times
larger), so granularity `microbatch` decides on the same tokens. Granularity `step` does not
depend on the split at all, which the uneven cases check: 5 + 3 sequences, and 8 + 0 (a rank
with no sequence, hence no response token), against the even split's reference.
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

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.model import load_whole_model_weights
from bapo_megatron.config import ActorConfig, OptimizerConfig, ParallelConfig
from bapo_megatron.distributed.context import ParallelContext
from tests.helpers import gloo_launch, layout_training
from tests.helpers.layout_training import (
    COMPARED,
    LAUNCH_TIMEOUT_S,
    NUM_SEQUENCES,
    OPTIMIZER,
    PARAM_TOLERANCE,
    run_result,
    whole_weights,
)
from tests.helpers.tiny_models import tiny_model

MODEL = tiny_model(
    model_type="qwen2",
    num_layers=4,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
ACTOR = ActorConfig(micro_batch_size=1, temperature=0.8, seed=3)
GRANULARITIES = ("step", "microbatch")
LAYOUTS = {
    "tp2-pp2": ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    "tp2-dp2": ParallelConfig(tensor_model_parallel_size=2),
    "pp2-dp2": ParallelConfig(pipeline_model_parallel_size=2),
    "tp2-sp-dp2": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2-vpp2-dp2": ParallelConfig(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    ),
}
UNEVEN = {"5+3": [5, 3], "8+0": [8, 0]}
BUDGET = dict(pack_sequences=True, max_tokens_per_microbatch=24)
PACKED = {  # layout: (run name, granularity, actor fields)
    "tp2-sp-dp2": [("packed budget step", "step", BUDGET)],
    "pp2-dp2": [("packed budget step", "step", BUDGET)],
    "tp2-pp2": [("packed microbatch", "microbatch", dict(pack_sequences=True))],
}
DENSE_COMPARED = (*COMPARED, "bapo/clip_frac_positive")


def sequences(initial_logprobs_of) -> PolicyBatch:
    return layout_training.sequences(initial_logprobs_of, MODEL.vocab_size, seed=20261123)


def shard_rows(batch: PolicyBatch, counts: list[int], rank: int) -> PolicyBatch:
    start = sum(counts[:rank])
    return batch.select(slice(start, start + counts[rank]))


def interleaved(batch: PolicyBatch, dp: int) -> PolicyBatch:
    """The order in which one process sees micro-batch i of every rank of an even dp split."""
    per_rank = batch.num_sequences // dp
    order = torch.arange(batch.num_sequences).view(dp, per_rank).t().reshape(-1)
    return dataclasses.replace(
        batch,
        tokens=batch.tokens[order],
        response_mask=batch.response_mask[order],
        old_logprobs=batch.old_logprobs[order],
        advantages=batch.advantages[order],
    )


def train(
    context: ParallelContext,
    weights: dict[str, torch.Tensor],
    batch: PolicyBatch,
    granularity: str,
    micro_batch_size: int = ACTOR.micro_batch_size,
    optimizer: OptimizerConfig = OPTIMIZER,
    **actor_fields,
) -> dict:
    """:func:`layout_training.train` with ACTOR's fields overridden by ``actor_fields``."""
    actor = dataclasses.replace(ACTOR, micro_batch_size=micro_batch_size, **actor_fields)
    return layout_training.train(MODEL, actor, context, weights, batch, granularity, optimizer)


def _assert_metrics_match(got: list[dict], want: list[dict], what: str) -> None:
    layout_training.assert_metrics_match(got, want, what, DENSE_COMPARED)


# ------------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> None:
    gloo_launch.join_group(args, timeout_s=300)
    data = torch.load(args.data, weights_only=False)
    weights, batch, finals = data["weights"], data["batch"], data["final_weights"]
    results: dict[str, object] = {}
    for layout_name, layout in LAYOUTS.items():
        context = ParallelContext.initialize(layout)
        dp = context.dp_size
        even = [NUM_SEQUENCES // dp] * dp
        local = shard_rows(batch, even, context.dp_rank)
        runs = {}
        for granularity in GRANULARITIES:
            run = train(context, weights, local, granularity)
            runs[granularity] = run_result(run, finals[(dp, granularity)], context)
        if layout_name == "tp2-dp2":  # Megatron's distributed optimizer: states sharded over DP
            run = train(
                context,
                weights,
                local,
                "step",
                optimizer=dataclasses.replace(OPTIMIZER, use_distributed_optimizer=True),
            )
            runs["distributed-optimizer step"] = run_result(run, finals[(dp, "step")], context)
        for name, granularity, fields in PACKED.get(layout_name, ()):
            run = train(context, weights, local, granularity, **fields)
            reference = finals[(dp if granularity == "microbatch" else 1, granularity)]
            runs[name] = run_result(run, reference, context)
        if dp == 2:
            for case, counts in UNEVEN.items():
                run = train(context, weights, shard_rows(batch, counts, context.dp_rank), "step")
                runs["uneven " + case] = run_result(run, finals[(1, "step")], context)
        actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
        load_whole_model_weights(actor.chunks, weights, context)
        logprobs, entropy = compute_logprobs(
            actor.chunks, local, context, batching=Batching(2), temperature=ACTOR.temperature
        )
        packed_logprobs, packed_entropy = compute_logprobs(
            actor.chunks,
            local,
            context,
            batching=Batching(pack=True, max_tokens=24),
            temperature=ACTOR.temperature,
        )
        rows = slice(context.dp_rank * even[0], (context.dp_rank + 1) * even[0])
        results[layout_name] = dict(
            runs=runs,
            rows=rows,
            logprobs=logprobs,
            entropy=entropy,
            packed_logprobs=packed_logprobs,
            packed_entropy=packed_entropy,
            dp=dp,
            ranks=(context.tp_rank, context.pp_rank, context.dp_rank),
        )
        context.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


# ------------------------------------------------------------------------ test


@pytest.mark.multiprocess
def test_layouts_match_the_single_process_run(tmp_path, single_process):
    context = single_process
    reference_actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
    weights = whole_weights(reference_actor)

    def initial_logprobs(batch: PolicyBatch) -> torch.Tensor:
        return compute_logprobs(
            reference_actor.chunks,
            batch,
            context,
            batching=Batching(3),
            temperature=ACTOR.temperature,
        )[0]

    batch = sequences(initial_logprobs)
    ref_logprobs, ref_entropy = compute_logprobs(
        reference_actor.chunks,
        batch,
        context,
        batching=Batching(NUM_SEQUENCES),
        temperature=ACTOR.temperature,
    )
    references = {}
    for dp in (1, 2):
        for granularity in GRANULARITIES:
            run = train(
                context,
                weights,
                batch if dp == 1 else interleaved(batch, dp),
                granularity,
                micro_batch_size=dp * ACTOR.micro_batch_size,
            )
            references[(dp, granularity)] = run
    # `step` does not depend on how the step is split: dp=1 and dp=2 orders agree.
    _assert_metrics_match(
        references[(2, "step")]["metrics"],
        references[(1, "step")]["metrics"],
        "one process, interleaved order",
    )
    # The search moved the bounds in some step, or the comparison below would be weak.
    assert any(m["bapo/search_steps"] > 0 for run in references.values() for m in run["metrics"])
    final_weights = {key: layout_training.final_weights(run) for key, run in references.items()}
    torch.save(
        dict(weights=weights, batch=batch, final_weights=final_weights), tmp_path / "data.pt"
    )

    results = gloo_launch.launch(
        __file__, 4, tmp_path, ["--data", tmp_path / "data.pt"], LAUNCH_TIMEOUT_S
    )
    errors = {}
    for rank, result in enumerate(results):
        for layout_name in LAYOUTS:
            got = result[layout_name]
            what = f"rank {rank} {layout_name} {got['ranks']}"
            torch.testing.assert_close(
                got["logprobs"],
                ref_logprobs[got["rows"]],
                rtol=1e-5,
                atol=1e-5,
                msg=what + " logprobs",
            )
            torch.testing.assert_close(
                got["entropy"],
                ref_entropy[got["rows"]],
                rtol=1e-5,
                atol=1e-5,
                msg=what + " entropy",
            )
            mask = batch.response_mask[got["rows"]]
            for key in ("logprobs", "entropy"):
                torch.testing.assert_close(
                    got["packed_" + key][mask],
                    {"logprobs": ref_logprobs, "entropy": ref_entropy}[key][got["rows"]][mask],
                    rtol=1e-5,
                    atol=1e-5,
                    msg=f"{what} packed {key}",
                )
            for run_name, run in got["runs"].items():
                dp = got["dp"] if run_name in GRANULARITIES else 1
                granularity = run_name if run_name in GRANULARITIES else "step"  # step: any split
                if run_name == "packed microbatch":  # packed by count: the padded micro-batches
                    dp, granularity = got["dp"], "microbatch"
                _assert_metrics_match(
                    run["metrics"], references[(dp, granularity)]["metrics"], f"{what} {run_name}"
                )
                errors[f"{what} {run_name}"] = run["param_error"]
    worst = max(errors, key=errors.get)
    assert errors[worst] < PARAM_TOLERANCE, f"{worst}: parameters differ by {errors[worst]:.3g}"


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], data=str))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
