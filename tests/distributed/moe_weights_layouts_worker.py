"""The worker of tests/distributed/test_moe_weights_layouts.py, started by
tests/helpers/gloo_launch.py in 2 processes.

It is a separate module, light at import time (everything heavy is imported in the functions),
for the reason tests/distributed/weights_layouts_worker.py gives: the checkpoint writer's queue
server is started with the ``spawn`` method, which re-imports ``__main__`` in its process, and
the worker waits for it; re-importing the test file cost that process torch's, transformers' and
Megatron's imports at each worker's first save, re-importing this file costs nothing.

At every layout of :data:`LAYOUTS` (the expert-parallel one first: the others load its
checkpoint) it converts the HF folder, records the token log-probs and entropy through the
pipeline, at EP2 what the live export yields on each rank, what the weight sync hands the
engines (colocated and disaggregated), and converts the checkpoint back to HF, and the EP2
checkpoint too at the other layouts. The parent test makes the comparisons.
"""

from __future__ import annotations

import sys

SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {  # name -> ParallelConfig fields; ep2 first: the others load its checkpoint
    "ep2": {"expert_model_parallel_size": 2},
    "tp2-sp-ep2": {**SP, "expert_model_parallel_size": 2},
    "tp2-sp": SP,
    "tp2-sp-etp2": {**SP, "expert_tensor_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
}


def token_batch():
    """The token batch of tests/helpers/hf_models.py as a PolicyBatch, every token after the
    first a response token (so every position's log-prob is computed and compared)."""
    import torch

    from bapo_megatron.actor.batch import PolicyBatch
    from tests.helpers import hf_models

    ids, _ = hf_models.tokens()
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    return PolicyBatch(tokens=ids, response_mask=mask)


def engine_view(chunks, model, context, placement: str):
    """What the weight sync hands an engine from this rank, exporting as it does
    (``weight_sync/``): colocated, every rank with all experts, each replica's tensor rank 0
    the engine's side; disaggregated, replica 0's dense tensors and the experts of expert
    data-parallel rank 0, replica 0's tensor rank 0 the sender. None on the other ranks."""
    from bapo_megatron.weights.export import export_weights

    disaggregated = placement == "disaggregated"
    dense = context.dp_rank == 0 if disaggregated else True
    experts = context.edp_rank == 0 if disaggregated else True
    buckets = export_weights(
        chunks, model, context, version=0, dense=dense, experts=experts, all_experts=True
    )
    tensors = {n: t.clone() for bucket in buckets for n, t in bucket.tensors.items()}
    sender = context.tp_rank == 0 and (context.dp_rank == 0 or not disaggregated)
    return tensors if sender else None


def main(argv: list[str]) -> None:
    # (gloo_launch.launch starts it with one thread per pool and the checkout on PYTHONPATH)
    from pathlib import Path

    import torch.distributed as dist

    from bapo_megatron.actor.logprobs import compute_logprobs
    from bapo_megatron.actor.microbatches import Batching
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf
    from bapo_megatron.weights.export import export_weights
    from tests.helpers import gloo_launch

    args = gloo_launch.worker_arguments(argv, workdir=str)
    gloo_launch.join_group(args, timeout_s=120)
    work = Path(args.workdir)
    results = {}
    for name, layout in LAYOUTS.items():
        context = ParallelContext.initialize(ParallelConfig(**layout))
        model, chunks = hf_to_megatron(work / "hf", work / f"ckpt-{name}", context)
        results["logprobs", name] = compute_logprobs(
            chunks, token_batch(), context, batching=Batching(2), temperature=1.0
        )
        if name == "ep2":  # what the live export yields on each rank
            results["export"] = [
                (bucket.expert_rank, sorted(bucket.tensors))
                for bucket in export_weights(
                    chunks, model, context, version=0, dense=context.dp_rank == 0
                )
            ]
        for placement in ("colocated", "disaggregated"):
            results["engine", name, placement] = engine_view(chunks, model, context, placement)
        megatron_to_hf(work / f"ckpt-{name}", work / f"hf-{name}", context)
        if name != "ep2":
            megatron_to_hf(work / "ckpt-ep2", work / f"hf-{name}-from-ep2", context)
        context.teardown()
    gloo_launch.save_result(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
