"""The CPU backend of :func:`bapo_megatron.algo.contributions.contribution_stats`: one fused
numba pass that buckets every token and accumulates all channels.

Torch's eager ops would take about a dozen passes over the tokens (bucketize twice, masks,
wheres, three bincounts), which on CPU costs more than the loss itself. The kernel is serial on
purpose: numba's parallel layers bring their own OpenMP runtime, whose spinning threads fight
torch's on small machines (seen: 40x slowdowns on 2 vCPUs), and one thread already keeps up
with the loss's memory traffic. Serial also makes the sums reproducible.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from bapo_megatron.algo.contributions import CHANNELS, EXTRAS, StatsLayout
from bapo_megatron.algo.search_plan import SearchPlan


@numba.njit(cache=True, nogil=True)
def _count_below(x, grid, inv_step):
    """#{grid values < x} for grid[0] < x <= grid[-1], the grid uniform up to its last value."""
    # int() truncates, which is floor here as x > grid[0]; math.ceil/floor cost twice as much.
    b = min(int((x - grid[0]) * inv_step) + 1, grid.shape[0] - 1)
    while grid[b - 1] >= x:  # the estimate is off by at most one except at a clamped last step
        b -= 1
    while grid[b] < x:
        b += 1
    return b


@numba.njit(cache=True, nogil=True)
def _count_at_most(x, grid, inv_step):
    """#{grid values <= x} for grid[0] <= x < grid[-1], the grid uniform up to its last value."""
    b = min(int((x - grid[0]) * inv_step) + 1, grid.shape[0] - 1)
    while grid[b - 1] > x:
        b -= 1
    while grid[b] <= x:
        b += 1
    return b


@numba.njit(cache=True, nogil=True)
def _histogram(ratio, log_ratio, adv, mask, highs, inv_high, lows, inv_low, dual_clip, has_dual):
    n = ratio.shape[0]
    num_high, num_low = highs.shape[0], lows.shape[0]
    pos_buckets = num_high + 1
    row = pos_buckets + num_low + 2
    hist = np.zeros(3 * row)
    first_high, last_high = highs[0], highs[num_high - 1]
    first_low, last_low = lows[0], lows[num_low - 1]
    # Scalars live in registers, not in hist: stores to hist[b] would otherwise alias them.
    zero_count = 0.0
    ratio_sum = 0.0
    kl_sum = 0.0
    r_min = np.inf
    r_max = -np.inf
    for i in range(n):
        # Masks and advantage signs come in runs (padding, per-sample advantages), so these
        # branches predict well.
        if not mask[i]:
            continue
        x = ratio[i]  # compared in its own dtype, like the loss's clamps
        # float64 from here on: products and sums as precise as the torch backend's.
        xd = np.float64(x)
        a = np.float64(adv[i])
        ratio_sum += xd
        kl_sum += xd - 1.0 - log_ratio[i]
        r_min = xd if xd < r_min else r_min  # numba's min() is much slower
        r_max = xd if xd > r_max else r_max
        if a > 0:
            # Most ratios sit near 1: the ends of the grid are checked before the search.
            if x <= first_high:
                b = 0
            elif x > last_high:
                b = num_high
            else:
                b = _count_below(x, highs, inv_high)
        elif a < 0:
            a = -a
            if has_dual and x > dual_clip:
                b = row - 1
            elif x >= last_low:
                b = pos_buckets + num_low
            elif x < first_low:
                b = pos_buckets
            else:
                b = pos_buckets + _count_at_most(x, lows, inv_low)
        else:
            zero_count += 1.0
            continue
        hist[b] += a * xd
        hist[row + b] += a
        hist[2 * row + b] += 1.0
    stats = np.empty(3 * row + 3)
    stats[: 3 * row] = hist
    stats[3 * row] = zero_count
    stats[3 * row + 1] = ratio_sum
    stats[3 * row + 2] = kl_sum
    return stats, r_min, r_max


def _inverse_step(values: tuple[float, ...], step: float) -> float:
    return 1.0 / step if len(values) > 1 else 0.0


def histogram_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, plan: SearchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`contribution_stats` for 1-D CPU tensors."""
    layout = StatsLayout.of(plan)
    assert layout.size == CHANNELS * layout.row + EXTRAS
    # Grids in the ratio's dtype: comparisons then match the loss's clamps bit for bit.
    dtype = ratio.dtype if ratio.dtype in (torch.float32, torch.float64) else torch.float32
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    r = ratio.to(dtype).contiguous().numpy()
    lr = log_ratio.to(dtype).contiguous().numpy()
    a = advantages.to(dtype).contiguous().numpy()
    m = mask.to(torch.bool).contiguous().numpy()
    highs = np.asarray(plan.c_high_values, dtype=np_dtype)
    lows = np.asarray(plan.c_low_values, dtype=np_dtype)
    cfg = plan.config
    dual = cfg.dual_clip
    stats, r_min, r_max = _histogram(
        r, lr, a, m,
        highs, _inverse_step(plan.c_high_values, cfg.c_high_step),
        lows, _inverse_step(plan.c_low_values, cfg.c_low_step),
        np_dtype(dual if dual is not None else 0.0), dual is not None,
    )
    return (torch.from_numpy(stats),
            torch.tensor([r_min, r_max], dtype=torch.float64))
