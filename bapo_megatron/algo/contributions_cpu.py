"""The CPU backend of :func:`bapo_megatron.algo.contributions.contribution_stats`: one fused
numba pass that buckets every token and accumulates all channels.

Torch's eager ops would take about a dozen passes over the tokens (bucketize twice, masks,
wheres, three bincounts), which on CPU costs more than the loss itself. Here each fixed-size
chunk of tokens fills its own histogram in parallel; chunk histograms are then summed in order,
so the result does not depend on the thread count.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from bapo_megatron.algo.contributions import CHANNELS, EXTRAS, StatsLayout
from bapo_megatron.algo.search_plan import SearchPlan

_CHUNK = 1 << 15  # tokens per histogram; fixed so sums are reproducible


@numba.njit(cache=True, nogil=True)
def _count_below(x, grid, inv_step):
    """#{grid values < x} for a sorted grid that is uniform up to its last value."""
    n = grid.shape[0]
    b = math.ceil((x - grid[0]) * inv_step) if inv_step > 0.0 else 0
    b = min(max(b, 0), n)
    while b > 0 and grid[b - 1] >= x:
        b -= 1
    while b < n and grid[b] < x:
        b += 1
    return b


@numba.njit(cache=True, nogil=True)
def _count_at_most(x, grid, inv_step):
    """#{grid values <= x} for a sorted grid that is uniform up to its last value."""
    n = grid.shape[0]
    b = math.floor((x - grid[0]) * inv_step) + 1 if inv_step > 0.0 else 1
    b = min(max(b, 0), n)
    while b > 0 and grid[b - 1] > x:
        b -= 1
    while b < n and grid[b] <= x:
        b += 1
    return b


@numba.njit(parallel=True, cache=True)
def _histogram(ratio, log_ratio, adv, mask, highs, inv_high, lows, inv_low, dual_clip,
               has_dual, chunk):
    n = ratio.shape[0]
    pos_buckets = highs.shape[0] + 1
    row = pos_buckets + lows.shape[0] + 2
    width = 3 * row + 3  # CHANNELS * row + EXTRAS, then min and max of r
    num_chunks = (n + chunk - 1) // chunk
    partial = np.zeros((num_chunks, width + 2))
    for c in numba.prange(num_chunks):
        hist = np.zeros(width + 2)
        r_min = np.inf
        r_max = -np.inf
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            if not mask[i]:
                continue
            # float64 from here on: products and sums as precise as the torch backend's.
            x = np.float64(ratio[i])
            a = np.float64(adv[i])
            hist[3 * row + 1] += x
            hist[3 * row + 2] += x - 1.0 - log_ratio[i]
            r_min = min(r_min, x)
            r_max = max(r_max, x)
            if a > 0:
                b = _count_below(ratio[i], highs, inv_high)
            elif a < 0:
                if has_dual and ratio[i] > dual_clip:
                    b = pos_buckets + lows.shape[0] + 1
                else:
                    b = pos_buckets + _count_at_most(ratio[i], lows, inv_low)
                a = -a
            else:
                hist[3 * row] += 1.0
                continue
            hist[b] += a * x
            hist[row + b] += a
            hist[2 * row + b] += 1.0
        hist[width] = r_min
        hist[width + 1] = r_max
        partial[c] = hist
    stats = np.zeros(width)
    r_min = np.inf
    r_max = -np.inf
    for c in range(num_chunks):
        stats += partial[c, :width]
        r_min = min(r_min, partial[c, width])
        r_max = max(r_max, partial[c, width + 1])
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
    # Keep numba's pool no larger than torch's, so one-thread ranks stay one-thread.
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    stats, r_min, r_max = _histogram(
        r, lr, a, m,
        highs, _inverse_step(plan.c_high_values, cfg.c_high_step),
        lows, _inverse_step(plan.c_low_values, cfg.c_low_step),
        np_dtype(dual if dual is not None else 0.0), dual is not None, _CHUNK,
    )
    return (torch.from_numpy(stats),
            torch.tensor([r_min, r_max], dtype=torch.float64))
