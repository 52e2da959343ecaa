"""Multi-process BAPO: 2 and 4 real gloo processes, each holding a contiguous slice of a batch,
choose the same clip bounds as one process holding all of it, and their summed losses and
gradients equal the single-process ones.

One launch per world size runs every case inside the workers (this file re-run as a script); the
parent builds the data, computes the single-process results and makes all comparisons. The
model is ``logp_new = logp_base + features @ theta`` with a shared parameter ``theta``, so the
ranks' theta gradients can be summed as a data-parallel all-reduce would.

Cases: presets `paper` and `reference`, every aggregation, the statistics backends `numba` and
`torch`, three ways of slicing the batch (even; uneven with one rank whose rows have no response
token; one rank holding no rows at all), and two granularities: `micro-batch` (each rank calls
``bapo_loss`` with the all-reduce, which searches) and `step` (each rank splits its slice into two
micro-batches, sums their ``contribution_stats``, reduces once, calls ``choose_bounds`` and then
``bapo_loss(..., decision=...)`` per micro-batch, accumulating gradients).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a worker: pin every thread pool before torch and numba load
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[_var] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import math
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import gloo_launch
from tests.helpers.distributed_loss_cases import (
    CASES,
    SPECIAL_RANK,
    build_case_data,
    occupied_ranks,
    plan_for,
    rank_part,
)

pytestmark = pytest.mark.multiprocess

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZES = (2, 4)
LAUNCH_TIMEOUT_S = 180.0  # whole launch (start, all cases, exit); a hang fails the test after this

# Decision metrics that are counts, grid values or ratios of counts: equal bit for bit. The rest
# are float sums whose order differs between one process and a reduce over ranks: 1e-12.
EXACT_METRICS = {
    "bapo/c_low",
    "bapo/c_high",
    "bapo/search_steps",
    "bapo/target_met",
    "bapo/tokens",
    "bapo/positive_tokens",
    "bapo/negative_tokens",
    "bapo/positive_token_share",
    "bapo/negative_token_share",
    "bapo/clip_frac_positive",
    "bapo/clip_frac_negative",
    "bapo/clip_frac_dual",
}
LOCAL_METRICS = {"bapo/ratio_min_local", "bapo/ratio_max_local"}


# ------------------------------------------------------------------------------- worker


def worker_main(argv: list[str]) -> None:
    args = gloo_launch.worker_arguments(argv, data=str, fail_rank=int)
    torch.set_num_threads(1)
    gloo_launch.join_group(args, timeout_s=LAUNCH_TIMEOUT_S)
    try:
        if args.rank == args.fail_rank:
            raise RuntimeError(f"injected failure on rank {args.rank}")
        payload = torch.load(args.data, weights_only=True)
        results = {}
        for case in CASES:
            if case.id in payload:
                results[case.id] = rank_part(payload[case.id], case, args.rank)
        dist.barrier()
        gloo_launch.save_result(results, args.out)
    finally:
        dist.destroy_process_group()


def launch(
    world_size: int,
    workdir: Path,
    data_path: Path,
    fail_rank: int = -1,
    timeout: float = LAUNCH_TIMEOUT_S,
) -> list[dict]:
    """Every rank's results of one launch of this file's workers (see
    tests/helpers/gloo_launch.py)."""
    return gloo_launch.launch(
        __file__, world_size, workdir, ["--data", data_path, "--fail-rank", fail_rank], timeout
    )


# ------------------------------------------------------------------------------- pytest


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world size -> (data, single-process results, per-rank results) for every case; each
    world size is launched once (a failed launch is remembered, not retried)."""
    cache: dict[int, object] = {}

    def get(world_size: int):
        if world_size not in cache:
            try:
                workdir = tmp_path_factory.mktemp(f"world{world_size}")
                start = time.monotonic()
                data, single = {}, {}
                for case in CASES:
                    data[case.id], single[case.id] = build_case_data(case, world_size)
                print(f"\n{world_size}-process data: {time.monotonic() - start:.1f} s", end="")
                data_path = workdir / "data.pt"
                torch.save(data, data_path)
                start = time.monotonic()
                ranks = launch(world_size, workdir, data_path)
                print(f"\n{world_size}-process launch: {time.monotonic() - start:.1f} s")
                cache[world_size] = (data, single, ranks)
            except Exception:
                cache[world_size] = traceback.format_exc()
        result = cache[world_size]
        if isinstance(result, str):
            pytest.fail(f"setting up the {world_size}-process run failed:\n{result}", pytrace=False)
        return result

    return get


def _close(got: float, want: float, rel: float, abs_: float = 0.0) -> bool:
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= max(rel * abs(want), abs_)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ranks_choose_the_single_process_bounds(runs, world_size, case):
    """Every rank ends with the single process's bounds, steps and global metrics, using exactly
    one reduce of the search statistics per step."""
    data, singles, ranks = runs(world_size)
    single = singles[case.id]
    per_rank = [r[case.id] for r in ranks]
    plan = plan_for(case.preset)
    where = f"{case.id}, world size {world_size}, seed {data[case.id]['seed']}"
    assert 0 < single["steps"] < plan.max_steps, where
    assert single["reduce_calls"] == 1, where
    chosen = (single["metrics"]["bapo/c_low"], single["metrics"]["bapo/c_high"])
    occupied = occupied_ranks(data[case.id])
    if len(occupied) >= 2:  # without the reduce some rank would have chosen other bounds
        assert any(tuple(data[case.id]["local_bounds"][r]) != chosen for r in occupied), where

    want = single["metrics"]
    for rank, got in enumerate(per_rank):
        at = f"{where}, rank {rank}"
        assert got["metrics"]["bapo/c_low"] == want["bapo/c_low"], at
        assert got["metrics"]["bapo/c_high"] == want["bapo/c_high"], at
        assert got["steps"] == single["steps"], at
        assert got["normalizer"] == single["normalizer"], at
        for key, value in want.items():
            if key in LOCAL_METRICS:
                continue
            assert key in got["metrics"], f"{at}: metric {key} missing"
            if key in EXACT_METRICS:
                assert got["metrics"][key] == value, (
                    f"{at}: {key} {got['metrics'][key]!r} != single process {value!r}"
                )
            else:
                assert _close(got["metrics"][key], value, 1e-12, 1e-15), (
                    f"{at}: {key} {got['metrics'][key]!r} vs single process {value!r}"
                )
        # Every bapo_loss call of a micro-batch step reports the step's decision.
        for call in got["metrics_per_call"]:
            assert (call["bapo/c_low"], call["bapo/c_high"]) == chosen, at
        # Exactly one reduce per step: inside bapo_loss when it searches, else by the caller.
        if case.granularity == "micro-batch":
            assert got["loss_reduce_calls"] == [1], at
            assert got["step_reduce_calls"] == 0, at
        else:
            assert got["loss_reduce_calls"] == [0, 0], at
            assert got["step_reduce_calls"] == 1, at
        # The reduced (global) metrics are the same bits on every rank.
        global_metrics = {k: v for k, v in got["metrics"].items() if k not in LOCAL_METRICS}
        first = {k: v for k, v in per_rank[0]["metrics"].items() if k not in LOCAL_METRICS}
        assert global_metrics == first, at

    # Local ratio extremes: their min / max over ranks are the single process's.
    mins = [r["metrics"]["bapo/ratio_min_local"] for r in per_rank]
    maxs = [r["metrics"]["bapo/ratio_max_local"] for r in per_rank]
    assert _close(min(mins), want["bapo/ratio_min_local"], 1e-12), where
    assert _close(max(maxs), want["bapo/ratio_max_local"], 1e-12), where
    if case.layout != "even":  # the rank without response tokens
        assert (mins[SPECIAL_RANK], maxs[SPECIAL_RANK]) == (math.inf, -math.inf), where


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rank_losses_and_gradients_sum_to_single_process(runs, world_size, case):
    """The ranks' losses and theta gradients sum to the single process's; each rank's per-token
    gradients are the single process's on its slice."""
    data, singles, ranks = runs(world_size)
    single = singles[case.id]
    per_rank = [r[case.id] for r in ranks]
    where = f"{case.id}, world size {world_size}, seed {data[case.id]['seed']}"

    loss = sum(r["loss"] for r in per_rank)
    torch.testing.assert_close(
        loss,
        single["loss"],
        rtol=1e-12,
        atol=1e-15,
        msg=lambda m: f"{where}: loss summed over ranks\n{m}",
    )

    theta_grad = sum(r["theta_grad"] for r in per_rank)
    want = single["theta_grad"]
    err = (theta_grad - want).norm() / want.norm()
    assert torch.isfinite(want).all() and want.norm() > 0, where
    assert err <= 1e-10, f"{where}: summed theta gradient, relative error {float(err):.3e}"
    for rank, got in enumerate(per_rank):
        err = (got["theta_grad_all_reduced"] - want).norm() / want.norm()
        assert err <= 1e-10, f"{where}, rank {rank}: all-reduced theta gradient, {float(err):.3e}"

    bounds = data[case.id]["bounds"]
    for rank, got in enumerate(per_rank):
        lo, hi = bounds[rank], bounds[rank + 1]
        torch.testing.assert_close(
            got["logp_grad"],
            single["logp_grad"][lo:hi],
            rtol=1e-12,
            atol=0.0,
            msg=lambda m, rank=rank: f"{where}, rank {rank}: per-token gradient of logp_new\n{m}",
        )
    if case.layout != "even":
        empty = per_rank[SPECIAL_RANK]
        assert float(empty["loss"]) == 0.0, where
        assert not empty["theta_grad"].any(), where


def test_a_failing_worker_fails_the_launch_without_hanging(tmp_path):
    """Rank 1 raises right after joining the group while rank 0 waits in a collective: the
    launch must come back quickly with rank 1's traceback."""
    case = CASES[0]
    data, _ = build_case_data(case, 2)
    data_path = tmp_path / "data.pt"
    torch.save({case.id: data}, data_path)
    start = time.monotonic()
    with pytest.raises(gloo_launch.WorkerFailure) as failure:
        launch(2, tmp_path, data_path, fail_rank=1, timeout=60.0)
    assert time.monotonic() - start < 60.0
    message = str(failure.value)
    assert "injected failure on rank 1" in message
    assert "Traceback" in message


if __name__ == "__main__":
    worker_main(sys.argv[1:])
    from bapo_megatron.process.end import skip_final_collection

    skip_final_collection()
