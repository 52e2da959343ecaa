"""The KL reference policy and the KL loss term give the single-process result at TP2 x PP2.

The tiny model of test_train_layouts: the reference is a copy of the initial weights built on
the actor's layout; its log-probs of the 8 sequences go into the batch, and the actor trains
3 steps with the k3 term in the loss (KL 0 at the first step, growing after). Compared with one
process: the reference's log-probs, and per step the loss, grad norm, bounds, `kl/mean` and
`kl/loss`.
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
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.model import global_parameter_name, load_whole_model_weights
from bapo_megatron.actor.reference import build_reference, copy_actor_weights
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.config import ParallelConfig
from bapo_megatron.config.kl import KLConfig
from bapo_megatron.distributed.context import ParallelContext
from tests.distributed.test_train_layouts import ACTOR, MODEL, sequences
from tests.helpers import gloo_launch
from tests.helpers.layout_training import LOSS, NUM_SEQUENCES, OPTIMIZER, STEPS, plan

LAYOUT = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
KL = KLConfig(coef=0.5, estimator="k3")
COMPARED = ("loss", "grad_norm", "bapo/c_low", "bapo/c_high", "kl/mean", "kl/loss")
LAUNCH_TIMEOUT_S = 600.0


def run(context: ParallelContext, weights: dict[str, torch.Tensor], batch: PolicyBatch) -> dict:
    """The reference's log-probs of ``batch`` and STEPS steps of the actor with the KL term."""
    actor = build_actor(MODEL, ACTOR, OPTIMIZER, context)
    load_whole_model_weights(actor.chunks, weights, context)
    reference = build_reference(actor, offload=True)
    copy_actor_weights(reference, actor)
    ref = reference.logprobs(batch, batching=Batching(3), temperature=ACTOR.temperature)
    batch = dataclasses.replace(batch, ref_logprobs=ref)
    metrics = [train_step(actor, batch, LOSS, plan("step"), kl=KL) for _ in range(STEPS)]
    return dict(ref_logprobs=ref, metrics=metrics)


def worker(args: argparse.Namespace) -> None:
    gloo_launch.join_group(args, timeout_s=300)
    data = torch.load(args.data, weights_only=False)
    context = ParallelContext.initialize(LAYOUT)
    result = run(context, data["weights"], data["batch"])
    result["ranks"] = (context.tp_rank, context.pp_rank)
    context.teardown()
    gloo_launch.save_result(result, args.out)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_reference_and_kl_loss_match_the_single_process_run(tmp_path, single_process):
    context = single_process
    initial = build_actor(MODEL, ACTOR, OPTIMIZER, context)
    weights = {
        global_parameter_name(c, n): p.detach().clone()
        for c in initial.chunks
        for n, p in c.module.named_parameters()
    }
    from bapo_megatron.actor.logprobs import compute_logprobs

    def initial_logprobs(batch: PolicyBatch) -> torch.Tensor:
        return compute_logprobs(
            initial.chunks, batch, context, batching=Batching(4), temperature=ACTOR.temperature
        )[0]

    batch = sequences(initial_logprobs)
    want = run(context, weights, batch)
    assert batch.num_sequences == NUM_SEQUENCES
    assert want["metrics"][0]["kl/mean"] < 1e-6 < want["metrics"][-1]["kl/mean"]
    torch.save(dict(weights=weights, batch=batch), tmp_path / "data.pt")

    results = gloo_launch.launch(
        __file__, 4, tmp_path, ["--data", tmp_path / "data.pt"], LAUNCH_TIMEOUT_S
    )
    for rank, got in enumerate(results):
        what = f"rank {rank} (TP, PP) {got['ranks']}"
        mask = batch.response_mask
        torch.testing.assert_close(
            got["ref_logprobs"][mask], want["ref_logprobs"][mask], rtol=1e-5, atol=1e-5, msg=what
        )
        for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
            for key in COMPARED:
                assert g[key] == pytest.approx(w[key], rel=2e-5, abs=2e-6), f"{what} {step} {key}"


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:], data=str))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
