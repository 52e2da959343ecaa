"""The CPU backend of :func:`bapo_megatron.algo.contributions.contribution_stats`: a numba
kernel that buckets every token and accumulates all channels in two tight passes.

Torch's eager ops would take about a dozen passes over the tokens (bucketize twice, masks,
wheres, three bincounts), which on CPU costs more than the loss itself. On a CPU the
cost of a histogram is in its memory traffic, not in the arithmetic: writing hist[b] while b is
still being computed stalls the pipeline, so pass 1 only computes each token's bucket (through a
lookup table, no search) and pass 2 only scatters, into four interleaved histograms so that
consecutive tokens of one bucket do not wait on each other (1.7x faster than one fused loop).

The kernel is serial on purpose: numba's parallel layers bring their own OpenMP runtime, whose
spinning threads fight torch's on small machines (up to 40x slower). Serial also
makes the sums reproducible.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.algo.stats_layout import CHANNELS, EXTRAS, StatsLayout

_MAX_CELLS = 1 << 14
_WAYS = 4  # interleaved histograms in pass 2


@functools.lru_cache(maxsize=64)
def grid_lookup(values: tuple[float, ...], dtype: str):
    """A table that counts grid values below x with one lookup and a few comparisons.

    Cell j of width w starts at ``origin + j * w``. Whatever x the arithmetic maps to cell j lies,
    rounding included, in the widened interval [origin + (j-1)w, origin + (j+2)w). ``base[j]``
    counts the grid values below that interval and ``edges[j]`` lists those inside it (+inf
    padded), so #{g < x} = base[j] + #{e in edges[j] : e < x} exactly, ties included (and
    #{g <= x} likewise with <=). Grid values are compared in the ratio's dtype, as the loss's
    clamps compare them.

    Returns ``(origin, 1 / w, base[int64, cells], edges[dtype, cells x k])``.
    """
    grid = np.asarray(values, dtype=dtype).astype(np.float64)
    span = grid[-1] - grid[0]
    min_gap = np.diff(grid).min() if len(grid) > 1 else 1.0
    # Cells of a third of the smallest gap hold at most two grid values per widened interval;
    # a tiny gap (a clamped last step just past the previous candidate) only costs a third edge.
    width = max(min_gap / 3.0, span / _MAX_CELLS, 1e-12)
    cells = int(math.ceil(span / width)) + 3
    origin = grid[0] - width
    low = origin + (np.arange(cells) - 1) * width
    high = origin + (np.arange(cells) + 2) * width
    base = np.searchsorted(grid, low, side="left").astype(np.int64)
    inside = [grid[(grid >= lo) & (grid < hi)] for lo, hi in zip(low, high)]
    edges = np.full((cells, max(1, max(len(v) for v in inside))), np.inf, dtype=dtype)
    for j, v in enumerate(inside):
        edges[j, : len(v)] = v
    assert base[-1] + (edges[-1] < np.inf).sum() == len(grid)  # the last cell sees every value
    return origin, 1.0 / width, base, edges


@numba.njit(cache=True, nogil=True, inline="always")
def _lookup(x, origin, inv_width, base, edges, inclusive):
    t = (np.float64(x) - origin) * inv_width
    last = base.shape[0] - 1
    t = t if t > 0.0 else 0.0  # ternaries, not min/max: numba's min/max are much slower
    t = t if t < last else np.float64(last)
    j = np.uint64(t)  # unsigned: numba skips its negative-index branches
    b = base[j]
    for k in range(edges.shape[1]):
        b += np.int64(edges[j, k] <= x) if inclusive else np.int64(edges[j, k] < x)
    return b


@numba.njit(cache=True, nogil=True)
def _histogram(
    ratio, log_ratio, adv, mask, high_table, low_table, num_high, num_low, dual_clip, has_dual
):
    n = ratio.shape[0]
    pos_buckets = num_high + 1
    row = pos_buckets + num_low + 2
    trash = row  # masked-out and zero-advantage tokens
    h_origin, h_inv, h_base, h_edges = high_table
    l_origin, l_inv, l_base, l_edges = low_table
    bucket = np.empty(n, np.int32)
    zero_count = 0.0
    ratio_sum = 0.0
    kl_sum = 0.0
    r_min = np.inf
    r_max = -np.inf
    # Pass 1: each token's bucket (masks and advantage signs come in runs: predictable).
    for i in range(n):
        if not mask[i]:
            bucket[i] = trash
            continue
        x = ratio[i]  # compared in its own dtype, like the loss's clamps
        xd = np.float64(x)  # sums in float64, as precise as the torch backend's
        a = adv[i]
        ratio_sum += xd
        kl_sum += xd - 1.0 - log_ratio[i]
        r_min = xd if xd < r_min else r_min
        r_max = xd if xd > r_max else r_max
        if a > 0:
            bucket[i] = _lookup(x, h_origin, h_inv, h_base, h_edges, False)
        elif a < 0:
            if has_dual and x > dual_clip:
                bucket[i] = row - 1
            else:
                bucket[i] = pos_buckets + _lookup(x, l_origin, l_inv, l_base, l_edges, True)
        else:
            zero_count += 1.0
            bucket[i] = trash
    # Pass 2: scatter |A| r, |A| and 1; way i % 4 breaks chains of same-bucket updates.
    width = row + 1
    hist = np.zeros((4, 3 * width))
    for i in range(n):
        b = np.uint64(bucket[i])
        way = i & 3
        xd = np.float64(ratio[i])
        w = abs(np.float64(adv[i]))
        hist[way, b] += w * xd
        hist[way, b + np.uint64(width)] += w
        hist[way, b + np.uint64(2 * width)] += 1.0
    total = hist.sum(axis=0)
    stats = np.empty(3 * row + 3)
    for c in range(3):
        stats[c * row : (c + 1) * row] = total[c * width : c * width + row]
    stats[3 * row] = zero_count
    stats[3 * row + 1] = ratio_sum
    stats[3 * row + 2] = kl_sum
    return stats, r_min, r_max


def histogram_stats(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    plan: SearchPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`contribution_stats` for 1-D CPU tensors."""
    layout = StatsLayout.of(plan)
    assert layout.size == CHANNELS * layout.row + EXTRAS
    dtype = ratio.dtype if ratio.dtype in (torch.float32, torch.float64) else torch.float32
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    r = ratio.to(dtype).contiguous().numpy()
    lr = log_ratio.to(dtype).contiguous().numpy()
    a = advantages.to(dtype).contiguous().numpy()
    m = mask.to(torch.bool).contiguous().numpy()
    dual = plan.config.dual_clip
    stats, r_min, r_max = _histogram(
        r,
        lr,
        a,
        m,
        grid_lookup(plan.c_high_values, np_dtype.__name__),
        grid_lookup(plan.c_low_values, np_dtype.__name__),
        layout.num_high,
        layout.num_low,
        np_dtype(dual if dual is not None else 0.0),
        dual is not None,
    )
    return torch.from_numpy(stats), torch.tensor([r_min, r_max], dtype=torch.float64)
