"""The shard-to-shard executor (bapo_megatron/resharding/execute.py) on four gloo processes: ranks
0 and 1 are trainer ranks, 2 and 3 a vLLM engine at tensor-parallel size 2 (qwen2, a vocabulary
of 150 that divides neither side, small buckets so the plan has many).

- trainer TP2 (two key/value heads) and trainer TP1 x DP2 (one key/value head, which both engine
  workers hold) into the engine: every engine worker's tensors equal vLLM's slicing of the full
  tensors (written out independently in tests/unit/test_reshard_plan.py), and each rank's counted
  bytes equal the plan's;
- one rank given a plan built with another bucket size: every rank raises the same error naming
  it, and no byte has moved;
- a sender missing a tensor the plan reads: every rank raises the same error naming rank and
  tensor.
- rank 0 dies in the middle of a transfer: the receiver it still owed a message, and every
  other rank that does not finish, ends with an error naming the bucket, within the wait's
  bound.

In one process, a rank that is both the trainer and the engine (every message to itself) copies
in place.
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np
import pytest
import torch

from tests.helpers import gloo_launch

GROUP_TIMEOUT_S = 30.0
BUCKET_BYTES = 4096
ENGINE_TP = 2
# name -> (trainer TP, trainer DP, key/value heads, tied embeddings)
DYING_BUCKET = 3  # rank 0 dies in the third bucket it takes part in
DYING_WAIT_S = 10.0  # bounds a point-to-point wait after that
CASES = {"tp2": (2, 1, 2, True), "tp1_dp2": (1, 2, 1, False)}


def case_setup(name: str, bucket_bytes: int = BUCKET_BYTES):
    """The model, full tensors, both sides' maps and the plan of one case: the same in every
    process."""
    from bapo_megatron.models.name_maps import name_map_for
    from bapo_megatron.models.vllm_shards import vllm_shard_map
    from bapo_megatron.resharding.plan import plan_reshard
    from tests.unit.test_reshard_plan import model_of, trainer_maps

    tp, dp, kv, tied = CASES[name]
    model = model_of("qwen2", kv, tied)
    trainer, _ = trainer_maps(model, tp, 1, dp, 1, 1)
    assert len(trainer) == 2
    engine = [vllm_shard_map(model, r, ENGINE_TP, 2 + r) for r in range(ENGINE_TP)]
    plan = plan_reshard(trainer, [engine], element_bytes=8, bucket_bytes=bucket_bytes)
    rng = np.random.default_rng(7)
    shapes = name_map_for("qwen2").hf_shapes(model)
    full = {hf: rng.standard_normal(shape) for hf, shape in shapes.items()}
    return model, full, trainer, engine, plan


def local_tensors(shard_map, full) -> dict[str, torch.Tensor]:
    """A trainer rank's local tensors sliced from the full ones per its map (NaN elsewhere)."""
    from bapo_megatron.models.shard_map import matrix_shape

    tensors = {n: np.full(int(np.prod(s)), np.nan) for n, s in shard_map.local_shapes}
    for region in shard_map.regions:
        flat = full[region.hf].reshape(-1)
        cols = matrix_shape(full[region.hf].shape)[1]
        tensors[region.local][region.local_indices()] = flat[region.hf_indices(cols)]
    shapes = shard_map.shapes()
    return {n: torch.from_numpy(t.reshape(shapes[n])) for n, t in tensors.items()}


def empty_targets(shard_map) -> dict[str, torch.Tensor]:
    return {n: torch.full(s, float("nan"), dtype=torch.float64) for n, s in shard_map.local_shapes}


def worker(args) -> None:
    import torch.distributed as dist

    from bapo_megatron.resharding.execute import ReshardError, execute_plan

    gloo_launch.join_group(args, timeout_s=GROUP_TIMEOUT_S)
    group = dist.group.WORLD
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    rank = args.rank
    results: dict[str, object] = {}

    def tensors_of(name, bucket_bytes=BUCKET_BYTES):
        _, full, trainer, engine, plan = case_setup(name, bucket_bytes)
        if rank < 2:
            return plan, local_tensors(trainer[rank], full), {}
        return plan, {}, empty_targets(engine[rank - 2])

    for name in CASES:
        plan, sources, targets = tensors_of(name)
        counts = execute_plan(plan, group, timeout=timeout, sources=sources, targets=targets)
        results[name] = {"counts": counts, "targets": {n: t.numpy() for n, t in targets.items()}}

    plan, sources, targets = tensors_of("tp2", BUCKET_BYTES // 2 if rank == 3 else BUCKET_BYTES)
    try:
        execute_plan(plan, group, timeout=timeout, sources=sources, targets=targets)
        results["mismatch"] = "ran"
    except ReshardError as error:
        results["mismatch"] = str(error)
    results["untouched"] = all(bool(t.isnan().all()) for t in targets.values())

    plan, sources, targets = tensors_of("tp2")
    read = sorted({c.source for b in plan.buckets for m in b if m.sender == 1 for c in m.copies})
    missing = read[0] if rank == 1 else None
    sources.pop(missing, None)
    try:
        execute_plan(plan, group, timeout=timeout, sources=sources, targets=targets)
        results["missing"] = "ran"
    except ReshardError as error:
        results["missing"] = str(error)
    results["missing_name"] = missing

    # Last: rank 0 dies in the middle of a transfer (after its results are written).
    import bapo_megatron.resharding.execute as execute

    plan, sources, targets = tensors_of("tp2")
    if rank == 0:
        exchange, calls = execute.exchange_bucket, []

        def dying_exchange(*args, **kwargs):
            calls.append(None)
            if len(calls) == DYING_BUCKET:
                gloo_launch.save_result(results, args_out)
                os._exit(0)
            return exchange(*args, **kwargs)

        args_out = args.out
        execute.exchange_bucket = dying_exchange
    try:
        short = datetime.timedelta(seconds=DYING_WAIT_S)
        execute_plan(plan, group, timeout=short, sources=sources, targets=targets)
        results["dies"] = "ran"
    except ReshardError as error:
        results["dies"] = str(error)
    gloo_launch.save_result(results, args.out)


@pytest.mark.multiprocess
def test_the_executor_fills_every_engine_worker_and_agrees_on_failures(tmp_path):
    from tests.unit.test_reshard_plan import vllm_expected

    results = gloo_launch.launch(__file__, 4, tmp_path, timeout=120.0)
    for name in CASES:
        model, full, _, _, plan = case_setup(name)
        assert len(plan.buckets) > 10
        for rank, result in enumerate(results):
            counts = result[name]["counts"]
            assert counts.sent_bytes == plan.sent_bytes().get(rank, 0), (name, rank)
            assert counts.received_bytes == plan.received_bytes().get(rank, 0), (name, rank)
            if rank < 2:
                assert counts.sent_bytes > 0 and counts.received_bytes == 0
                continue
            assert counts.buckets > 1
            got = result[name]["targets"]
            want = vllm_expected(model, full, rank - 2, ENGINE_TP)
            assert sorted(got) == sorted(want)
            for tensor in want:
                np.testing.assert_array_equal(got[tensor], want[tensor], err_msg=(name, tensor))
        if name == "tp1_dp2":  # both data-parallel replicas send
            assert all(results[r][name]["counts"].sent_bytes > 0 for r in (0, 1))

    mismatch = {result["mismatch"] for result in results}
    assert len(mismatch) == 1, mismatch
    message = mismatch.pop()
    assert message.startswith("shard-to-shard transfer: rank 3: ValueError: plan digest ")
    assert "the digest of ranks [0, 1, 2]" in message and "rank 0:" not in message
    assert results[2]["untouched"] and results[3]["untouched"]

    missing = {result["missing"] for result in results}
    assert len(missing) == 1, missing
    name = results[1]["missing_name"]
    assert missing.pop() == (
        f"shard-to-shard transfer: rank 1: ValueError: no source tensor {name!r} "
        "(the plan's copies use it)"
    )
    # every receiver rank 0 still owed a message ends with an error naming the bucket; the
    # others end either way (a send completes once its bytes are written out; a rank that fails
    # leaves its peers too)
    _, _, _, _, plan = case_setup("tp2")
    dying = [i for i, b in enumerate(plan.buckets) if any(m.sender == 0 for m in b)][
        DYING_BUCKET - 1
    ]
    owed = {m.receiver for b in plan.buckets[dying:] for m in b if m.sender == 0}
    assert owed
    for rank in (1, 2, 3):
        outcome = results[rank]["dies"]
        if rank in owed or outcome != "ran":
            assert outcome.startswith(f"shard-to-shard transfer: rank {rank}: bucket "), outcome


def test_a_rank_that_sends_to_itself_copies_in_place(single_process):
    import torch.distributed as dist

    from bapo_megatron.models.vllm_shards import vllm_shard_map
    from bapo_megatron.resharding.execute import execute_plan
    from bapo_megatron.resharding.plan import plan_reshard
    from tests.unit.test_reshard_plan import model_of, trainer_maps, vllm_expected

    _, full, _, _, _ = case_setup("tp1_dp2")
    model = model_of("qwen2", 1, False)
    [trainer], _ = trainer_maps(model, 1, 1, 1, 1, 1)
    engine = vllm_shard_map(model, 0, 1, 0)
    plan = plan_reshard([trainer], [[engine]], element_bytes=8, bucket_bytes=BUCKET_BYTES)
    targets = empty_targets(engine)
    counts = execute_plan(
        plan,
        dist.group.WORLD,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        sources=local_tensors(trainer, full),
        targets=targets,
    )
    assert (counts.sent_bytes, counts.received_bytes) == (0, 0)
    want = vllm_expected(model, full, 0, 1)
    assert sorted(targets) == sorted(want)
    for name, tensor in want.items():
        np.testing.assert_array_equal(targets[name].numpy(), tensor, err_msg=name)


if __name__ == "__main__":
    worker(gloo_launch.worker_arguments(sys.argv[1:]))
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
