"""Walk the search path on reduced statistics and pick the clip bounds (docs/algorithm.md
sections 3-4).

Given the statistics vector of :mod:`bapo_megatron.algo.contributions`, already summed over the
data x context parallel group, P is known at every c_high candidate and N at every c_low
candidate (P depends only on c_high, N only on c_low):

    gradient:  P(h) = sum_{A>0, r<=h} A r           N(l) = sum_{A<0, l<=r(<=C)} |A| r
    surrogate: P(h) = sum_{A>0} A min(r, h)         N(l) = sum_{A<0} |A| max(r, l)

The target is met at a path position when N = 0 or, in the `share` unit, P/(P+N) >= rho0, or
in the `ratio` unit, P/N >= q0. Both schedules stop at the first position where it is met, or at
the end of the path. Everything here is tensor arithmetic on ~50 numbers: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.algo.stats_layout import StatsLayout


@dataclass(frozen=True)
class BoundDecision:
    """Bounds chosen for one update and the global metrics behind them (0-dim tensors)."""

    c_low: torch.Tensor
    c_high: torch.Tensor
    steps: torch.Tensor
    """Moves taken along the path (int64)."""
    metrics: dict[str, torch.Tensor]
    """The quantities of docs/algorithm.md section 8 over the whole reduced batch, keyed
    `bapo/...`."""


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """out[i] = sum(x[i:]), with one extra trailing zero (out[len(x)] = 0)."""
    padded = torch.cat([x, x.new_zeros(1)])
    return padded.flip(0).cumsum(0).flip(0)


def _contributions(
    parts: dict[str, torch.Tensor], plan: SearchPlan, grids: dict[str, torch.Tensor]
):
    """P at every c_high candidate and N at every c_low candidate."""
    num_high, num_low = len(plan.c_high_values), len(plan.c_low_values)
    pos_wr, pos_w = parts["pos_weighted_ratio"], parts["pos_weight"]
    neg_wr, neg_w = parts["neg_weighted_ratio"], parts["neg_weight"]
    # Positive bucket b holds tokens with #{h < r} = b: unclipped at h_j iff b <= j.
    unclipped_pos = pos_wr.cumsum(0)[:num_high]
    # Negative bucket b holds tokens with #{l <= r} = b (b = num_low + 1: dual-clipped, r > C):
    # unclipped at l_k iff b >= k + 1.
    neg_suffix = _suffix_sum(neg_wr[: num_low + 1])
    unclipped_neg = neg_suffix[1 : num_low + 1]
    if plan.config.semantics == "gradient":
        return unclipped_pos, unclipped_neg
    above = _suffix_sum(pos_w)[1 : num_high + 1]  # weight of tokens with r > h_j
    positive = unclipped_pos + grids["c_high"] * above
    below = neg_w.cumsum(0)[:num_low]  # weight of tokens with r < l_k
    negative = unclipped_neg + neg_wr[num_low + 1] + grids["c_low"] * below
    return positive, negative


def _target_met(positive: torch.Tensor, negative: torch.Tensor, plan: SearchPlan) -> torch.Tensor:
    cfg = plan.config
    no_negative = negative == 0
    safe_negative = torch.where(no_negative, 1.0, negative)
    if cfg.target_unit == "share":
        value = positive / (positive + safe_negative)
    else:
        value = positive / safe_negative
    return no_negative | (value >= cfg.target)


def _share(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    total = positive + negative
    return torch.where(total > 0, positive / torch.where(total > 0, total, 1.0), 0.0)


def choose_bounds(stats: torch.Tensor, plan: SearchPlan) -> BoundDecision:
    """Pick (c_low, c_high) from statistics already reduced over the data x context group."""
    layout = StatsLayout.of(plan)
    if stats.shape != (layout.size,):
        raise ValueError(
            f"stats: expected shape ({layout.size},) for this plan, got {tuple(stats.shape)}"
        )
    stats = stats.to(torch.float64)
    grids = plan.tensors(stats.device)
    parts = layout.split(stats)
    positive, negative = _contributions(parts, plan, grids)

    path_pos = positive[grids["path_high"]]
    path_neg = negative[grids["path_low"]]
    met = _target_met(path_pos, path_neg, plan)
    last = len(plan.path) - 1
    # argmax returns the first maximum: the first met position, if any.
    chosen = torch.where(met.any(), met.to(torch.int64).argmax(), last)
    low_index, high_index = grids["path_low"][chosen], grids["path_high"][chosen]
    c_low, c_high = grids["c_low"][low_index], grids["c_high"][high_index]

    pos_count, neg_count = parts["pos_count"], parts["neg_count"]
    pos_tokens, neg_tokens = pos_count.sum(), neg_count.sum()
    tokens = pos_tokens + neg_tokens + parts["zero_count"]
    num_low = len(plan.c_low_values)
    pos_clipped = _suffix_sum(pos_count)[high_index + 1]
    neg_clipped = neg_count.cumsum(0)[low_index]
    one = torch.ones((), dtype=torch.float64, device=stats.device)
    rho = _share(path_pos, path_neg)
    metrics = {
        "bapo/c_low": c_low,
        "bapo/c_high": c_high,
        "bapo/search_steps": chosen.to(torch.float64),
        "bapo/rho_before": rho[0],
        "bapo/rho_after": rho[chosen],
        "bapo/positive_contribution": path_pos[chosen],
        "bapo/negative_contribution": path_neg[chosen],
        "bapo/target_met": met[chosen].to(torch.float64),
        "bapo/tokens": tokens,
        "bapo/positive_tokens": pos_tokens,
        "bapo/negative_tokens": neg_tokens,
        "bapo/positive_token_share": pos_tokens / torch.maximum(tokens, one),
        "bapo/negative_token_share": neg_tokens / torch.maximum(tokens, one),
        "bapo/clip_frac_positive": pos_clipped / torch.maximum(pos_tokens, one),
        "bapo/clip_frac_negative": neg_clipped / torch.maximum(neg_tokens, one),
        "bapo/clip_frac_dual": neg_count[num_low + 1] / torch.maximum(neg_tokens, one),
        "bapo/ratio_mean": parts["ratio_sum"] / torch.maximum(tokens, one),
        "bapo/approx_kl": parts["kl_sum"] / torch.maximum(tokens, one),
    }
    return BoundDecision(c_low=c_low, c_high=c_high, steps=chosen, metrics=metrics)
