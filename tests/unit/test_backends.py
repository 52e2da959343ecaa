"""The numba and torch statistics backends build the same vector (what the core imports without:
tests/unit/test_package_structure.py)."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.algo import SearchPlan, contribution_stats, importance_ratio
from bapo_megatron.config import ClipSearchConfig
from tests.helpers.random_batches import SEARCH_VARIANTS, random_batch


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("preset,overrides", SEARCH_VARIANTS)
def test_numba_and_torch_backends_agree(preset, overrides, dtype):
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset(preset, **overrides))
    for seed in range(10):
        batch = random_batch(seed, dtype=dtype, batch=40, tokens=300)
        ratio, log_ratio = importance_ratio(batch["logp_new"].detach(), batch["logp_old"])
        adv = batch["advantages"]
        adv = adv[:, None].expand_as(ratio) if adv.dim() == 1 else adv
        mask = batch["mask"]
        by_numba, ext_numba = contribution_stats(ratio, log_ratio, adv, mask, plan, "numba")
        by_torch, ext_torch = contribution_stats(ratio, log_ratio, adv, mask, plan, "torch")
        torch.testing.assert_close(by_numba, by_torch, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(ext_numba, ext_torch, rtol=0, atol=0)


def test_ties_on_grid_values_follow_the_loss_convention():
    # r exactly on a candidate: unclipped (counted) on both sides, in both backends.
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
    ratio = torch.tensor([1.2, 1.25, 0.6, 0.62, 3.0, 0.9], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(6, dtype=torch.bool)
    for backend in ("numba", "torch"):
        stats, _ = contribution_stats(ratio, ratio.log(), adv, mask, plan, backend)
        counts = stats[2 * (38 + 18) : 3 * (38 + 18)]
        pos, neg = counts[:38], counts[38:]
        assert pos[0] == 1 and pos[1] == 1 and pos[36] == 1  # #{h < r} = 0, 1, 36
        assert neg[1] == 1 and neg[2] == 1 and neg[16] == 1  # #{l <= r} = 1, 2, 16


@pytest.mark.parametrize(
    "values",
    [
        (
            0.6,
            0.62,
            0.64,
            0.66,
            0.68,
            0.7,
            0.72,
            0.74,
            0.76,
            0.78,
            0.8,
            0.82,
            0.84,
            0.86,
            0.88,
            0.9,
        ),
        (1.2, 1.5, 1.8, 2.0),  # clamped last step
        (1.2, 1.25, 1.3, 1.3000001),  # a last step far smaller than the others
        (1.28,),  # fixed clip
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_grid_lookup_counts_exactly_like_searchsorted(values, dtype):
    import numpy as np

    from bapo_megatron.algo.contributions_cpu import _lookup, grid_lookup

    grid = np.asarray(values, dtype=dtype)
    # Every grid value, its float neighbours, and random points around the grid.
    near = np.concatenate([grid, np.nextafter(grid, np.inf), np.nextafter(grid, -np.inf)])
    rng = np.random.default_rng(0)
    spread = rng.uniform(grid[0] - 1.0, grid[-1] + 1.0, 5000).astype(dtype)
    xs = np.concatenate([near.astype(dtype), spread, np.array([0.0, 1e9], dtype=dtype)])
    table = grid_lookup(tuple(values), dtype)
    for inclusive, side in ((False, "left"), (True, "right")):
        want = np.searchsorted(grid, xs, side=side)
        got = np.array([_lookup.py_func(x, *table, inclusive) for x in xs])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "preset,overrides",
    [("paper", {}), ("reference", {"c_high_step": 0.3}), ("paper", {"dual_clip": 3.0})],
)
def test_backends_agree_on_ratios_at_and_next_to_every_candidate(preset, overrides, dtype):
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset(preset, **overrides))
    grid = torch.tensor(plan.c_low_values + plan.c_high_values + (3.0,), dtype=dtype)
    ratio = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    ratio = ratio.repeat(2)
    half = torch.ones(len(ratio) // 2, dtype=dtype)
    adv = torch.cat([half, -half])
    mask = torch.ones_like(ratio, dtype=torch.bool)
    by_numba, _ = contribution_stats(ratio, ratio.log(), adv, mask, plan, "numba")
    by_torch, _ = contribution_stats(ratio, ratio.log(), adv, mask, plan, "torch")
    torch.testing.assert_close(by_numba, by_torch, rtol=1e-12, atol=1e-12)


def test_deterministic_gpu_sums_equal_bincount_against_float64():
    """The per-bucket sums a GPU in deterministic mode takes (``index_add_``) against
    ``bincount`` and a float64 loop, on fresh random buckets (run here on the CPU: the branch is
    chosen by the caller, the arithmetic is the same on both devices)."""
    from bapo_megatron.algo.contributions import _bucket_sums

    g = torch.Generator().manual_seed(11)
    bucket = torch.randint(0, 9, (5000,), generator=g)
    weights = torch.rand(5000, generator=g, dtype=torch.float64)
    by_loop = torch.zeros(10, dtype=torch.float64)
    counts = torch.zeros(10, dtype=torch.float64)
    for b, w in zip(bucket.tolist(), weights.tolist()):
        by_loop[b] += w
        counts[b] += 1
    for index_add in (False, True):
        sums = _bucket_sums(bucket, weights, 10, index_add)
        torch.testing.assert_close(sums, by_loop, rtol=1e-12, atol=1e-12)
        assert torch.equal(_bucket_sums(bucket, None, 10, index_add).to(torch.float64), counts)
