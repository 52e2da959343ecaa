"""One pass over the tokens: everything the bound search needs, at every candidate bound.

Each response token with advantage A != 0 falls in one bucket of its side's candidate grid:

- A > 0: bucket b = #{c_high candidates < r}. The token is unclipped (carries gradient) at
  c_high_j exactly when b <= j.
- A < 0: bucket b = #{c_low candidates <= r}. The token is unclipped at c_low_k exactly when
  b >= k + 1. With a dual clip C, tokens with r > C go to one extra bucket (they carry no
  gradient whatever c_low is).

Per bucket three channels are summed: |A|*r, |A| and the token count. Prefix and suffix sums of
these give P(c_high) and N(c_low) at every candidate under both semantics
(:mod:`bapo_megatron.algo.bound_search`), and the clip fractions at the chosen bounds. Three
totals follow: the count of zero-advantage response tokens, the sum of ratios and the sum of the
k3 KL estimate r - 1 - log r. The whole vector is summed across ranks with one collective.

Two backends build the same vector: a numba kernel on CPU (one fused pass, deterministic chunked
sums) and torch ops elsewhere (bucketize + bincount).
"""

from __future__ import annotations

from typing import Literal

import torch

from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.algo.stats_layout import StatsLayout

Backend = Literal["auto", "torch", "numba"]


def contribution_stats(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    plan: SearchPlan,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local statistics of one batch for the bound search, not yet reduced across ranks.

    Args:
        ratio: importance ratios r (no grad needed), any shape.
        log_ratio: the clamped log r the ratios came from, same shape (for the KL estimate).
        advantages: effective advantages (times any importance weight), same shape (expand
            per-sequence advantages first; :func:`bapo_megatron.algo.search_statistics` does).
        mask: response-token mask, same shape (bool).
        plan: the search's candidate grids.
        backend: `numba` (CPU), `torch`, or `auto` (numba for CPU tensors when installed).

    Returns:
        ``(stats, extremes)``: the float64 vector laid out by :class:`StatsLayout`, to be summed
        over the data x context parallel group; and ``[min r, max r]`` over this batch's response
        tokens (+inf, -inf when it has none), to be reduced with MIN/MAX if wanted.
    """
    for name, tensor in (("log_ratio", log_ratio), ("advantages", advantages), ("mask", mask)):
        if tensor.shape != ratio.shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match ratio {tuple(ratio.shape)}"
            )
    ratio, log_ratio = ratio.detach().reshape(-1), log_ratio.detach().reshape(-1)
    advantages, mask = advantages.detach().reshape(-1), mask.reshape(-1)
    if backend == "auto":
        backend = "numba" if ratio.device.type == "cpu" and _numba_available() else "torch"
    if backend == "numba":
        # lazy backend: GPU runs never load numba (LLVM)
        from bapo_megatron.algo import contributions_cpu

        return contributions_cpu.histogram_stats(ratio, log_ratio, advantages, mask, plan)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'torch' or 'numba', got {backend!r}")
    return _torch_stats(ratio, log_ratio, advantages, mask, plan)


def _numba_available() -> bool:
    try:
        # lazy: only CPU runs ask, and a numba that fails to import falls back to torch
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def _bucket_sums(
    bucket: torch.Tensor, weights: torch.Tensor | None, size: int, index_add: bool
) -> torch.Tensor:
    """Per-bucket sums of ``weights`` (counts when None): ``bincount``, or with ``index_add``
    (a GPU in deterministic mode, where CUDA's ``bincount`` has no deterministic kernel and
    ``index_add_`` has one) an ``index_add_`` into zeros."""
    if index_add:
        values = torch.ones_like(bucket) if weights is None else weights
        flat = bucket.reshape(-1)
        return torch.zeros(size, dtype=values.dtype, device=bucket.device).index_add_(
            0, flat, values.reshape(-1)
        )
    return torch.bincount(bucket, weights=weights, minlength=size)


def _torch_stats(ratio, log_ratio, advantages, mask, plan):
    layout = StatsLayout.of(plan)
    grids = plan.tensors(ratio.device)
    # Compare in the ratio's dtype, as the loss's clamps do, so search and loss agree on ties.
    highs, lows = grids["c_high"].to(ratio.dtype), grids["c_low"].to(ratio.dtype)
    pos_bucket = torch.bucketize(ratio, highs, right=False)
    neg_bucket = torch.bucketize(ratio, lows, right=True)
    dual_clip = plan.config.dual_clip
    if dual_clip is not None:
        neg_bucket = torch.where(ratio > dual_clip, layout.num_low + 1, neg_bucket)
    trash = layout.row
    bucket = torch.where(
        mask & (advantages > 0),
        pos_bucket,
        torch.where(mask & (advantages < 0), neg_bucket + layout.positive_buckets, trash),
    )
    weight = advantages.abs().to(torch.float64)
    weighted_ratio = weight * ratio.to(torch.float64)
    size = layout.row + 1
    index_add = ratio.is_cuda and torch.are_deterministic_algorithms_enabled()
    channels = [
        _bucket_sums(bucket, weighted_ratio, size, index_add)[: layout.row],
        _bucket_sums(bucket, weight, size, index_add)[: layout.row],
        _bucket_sums(bucket, None, size, index_add)[: layout.row].to(torch.float64),
    ]
    r64 = torch.where(mask, ratio, 0).to(torch.float64)
    kl = torch.where(mask, r64 - 1 - log_ratio.to(torch.float64), 0)
    extras = torch.stack(
        [
            (mask & (advantages == 0)).sum().to(torch.float64),
            r64.sum(),
            kl.sum(),
        ]
    )
    stats = torch.cat(channels + [extras])
    extremes = torch.stack(
        [
            torch.where(mask, ratio, float("inf")).amin()
            if ratio.numel()
            else ratio.new_tensor(float("inf")),
            torch.where(mask, ratio, float("-inf")).amax()
            if ratio.numel()
            else ratio.new_tensor(float("-inf")),
        ]
    ).to(torch.float64)
    return stats, extremes
