"""A plain, step-by-step implementation of the BAPO bound search and loss, written from
docs/algorithm.md without the vectorised machinery: the reference the package is tested against.

Each search step recomputes P and N from the tokens and reduces them (as the authors' code does,
one collective and one host sync per step). Works in the inputs' dtype; tests pass float64.
The benchmark uses it as the step-by-step baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ReferenceResult:
    c_low: float
    c_high: float
    steps: int
    rho_before: float
    rho_after: float
    positive: float
    negative: float


def ratio_of(logp_new, logp_old):
    return torch.exp(torch.clamp(logp_new - logp_old, -20.0, 20.0))


def contributions(r, adv, mask, c_low, c_high, semantics, dual_clip, reduce):
    """(P, N) at one pair of bounds, summed over ranks by ``reduce``."""
    mask = mask.bool()
    pos = mask & (adv > 0)
    neg = mask & (adv < 0)
    if semantics == "gradient":
        p = (adv * r)[pos & (r <= c_high)].sum()
        keep = neg & (r >= c_low)
        if dual_clip is not None:
            keep = keep & (r <= dual_clip)
        n = (-adv * r)[keep].sum()
    else:
        p = (adv * torch.clamp(r, max=c_high))[pos].sum()
        n = (-adv * torch.clamp(r, min=c_low))[neg].sum()
    both = reduce(torch.stack([p, n]).to(torch.float64))
    p, n = both.tolist()  # host sync, as in the authors' loop
    return p, n


def met(p, n, unit, target):
    if n == 0:
        return True
    return (p / (p + n) if unit == "share" else p / n) >= target


def share(p, n):
    return p / (p + n) if p + n > 0 else 0.0


def search(r, adv, mask, cfg, reduce=lambda x: x) -> ReferenceResult:
    """Walk the schedule of ``cfg`` (a ClipSearchConfig) one step at a time."""
    args = (cfg.semantics, cfg.dual_clip, reduce)
    if cfg.schedule == "paper":
        k_low_max = math.floor((cfg.c_low_max - cfg.c_low_start) / cfg.c_low_step + 1e-9)
        k_high_max = math.floor((cfg.c_high_max - cfg.c_high_start) / cfg.c_high_step + 1e-9)

        def low(k):
            return round(cfg.c_low_start + k * cfg.c_low_step, 12)

        def high(k):
            return round(cfg.c_high_start + k * cfg.c_high_step, 12)
    else:
        k_low_max = max(0, math.ceil((cfg.c_low_max - cfg.c_low_start) / cfg.c_low_step - 1e-9))
        k_high_max = max(0, math.ceil((cfg.c_high_max - cfg.c_high_start) / cfg.c_high_step - 1e-9))

        def low(k):
            return min(round(cfg.c_low_start + k * cfg.c_low_step, 12), cfg.c_low_max)

        def high(k):
            return min(round(cfg.c_high_start + k * cfg.c_high_step, 12), cfg.c_high_max)

    k_low = k_high = steps = 0
    p, n = contributions(r, adv, mask, low(0), high(0), *args)
    rho_before = share(p, n)
    if p + n == 0:  # every advantage zero: no search
        return ReferenceResult(low(0), high(0), 0, rho_before, rho_before, p, n)
    if cfg.schedule == "paper":
        # Algorithm 1: while rho < rho0 and c_low + d2 <= b-: c_high first, then c_low.
        while not met(p, n, cfg.target_unit, cfg.target) and k_low + 1 <= k_low_max:
            if k_high + 1 <= k_high_max:
                k_high += 1
            else:
                k_low += 1
            steps += 1
            p, n = contributions(r, adv, mask, low(k_low), high(k_high), *args)
    else:
        # The authors' code: c_low to its max first, then c_high.
        while not met(p, n, cfg.target_unit, cfg.target) and k_low < k_low_max:
            k_low += 1
            steps += 1
            p, n = contributions(r, adv, mask, low(k_low), high(k_high), *args)
        while not met(p, n, cfg.target_unit, cfg.target) and k_high < k_high_max:
            k_high += 1
            steps += 1
            p, n = contributions(r, adv, mask, low(k_low), high(k_high), *args)
    return ReferenceResult(low(k_low), high(k_high), steps, rho_before, share(p, n), p, n)


def loss_and_grad(
    logp_new,
    logp_old,
    adv,
    mask,
    c_low,
    c_high,
    dual_clip,
    aggregation,
    normalizer,
    is_weights=None,
):
    """Loss value and its textbook gradient w.r.t. logp_new, written out by hand:
    dL_t/dlogp_new_t = -A_t w_t r_t for unclipped tokens, 0 for clipped ones (and 0 where the
    log-ratio clamp at +-20 is active)."""
    mask = mask.bool()
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp_new)
    w = torch.ones_like(logp_new) if is_weights is None else is_weights
    log_r = logp_new - logp_old
    r = torch.exp(torch.clamp(log_r, -20.0, 20.0))
    surrogate = torch.minimum(r * adv, torch.clamp(r, c_low, c_high) * adv)
    per_token = -surrogate
    unclipped = torch.where(adv > 0, r <= c_high, r >= c_low)
    if dual_clip is not None:
        capped = (adv < 0) & (r > dual_clip)
        per_token = torch.where(capped, -adv * dual_clip, per_token)
        unclipped = unclipped & ~capped
    per_token = per_token * w
    d_token = torch.where(unclipped & (log_r.abs() <= 20.0), -adv * w * r, torch.zeros_like(r))
    d_token = torch.where(mask, d_token, torch.zeros_like(r))
    per_token = torch.where(mask, per_token, torch.zeros_like(r))
    count = mask.sum(-1).clamp(min=1).to(r.dtype)
    if aggregation == "seq-mean-token-mean":
        total = (per_token.sum(-1) / count).sum()
        grad = d_token / count[:, None]
    else:
        total = per_token.sum()
        grad = d_token
    denom = max(float(normalizer), 1.0)
    return total / denom, grad / denom
