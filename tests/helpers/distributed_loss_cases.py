"""The cases of tests/distributed/test_distributed_loss.py: every preset x aggregation x slicing
of the batch x granularity x statistics backend, the data of each, its single-process result
and the part one rank of a gloo group computes of it."""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.algo import (
    SearchPlan,
    all_reduce_sum,
    bapo_loss,
    choose_bounds,
    contribution_stats,
    identity_reduce,
    importance_ratio,
    loss_normalizer,
)
from bapo_megatron.config import AGGREGATIONS, ClipSearchConfig

BATCH, TOKENS, FEATURES = 24, 16, 3

PRESETS = ("paper", "reference")
LAYOUTS = ("even", "uneven-empty-rank", "rank-without-rows")
GRANULARITIES = ("micro-batch", "step")
BACKENDS = ("numba", "torch")

# Slice boundaries (rows) per world size for the uneven layouts; the chosen rank is rank 1.
UNEVEN_BOUNDS = {2: [0, 15, 24], 4: [0, 9, 14, 17, 24]}
NO_ROWS_BOUNDS = {2: [0, 24, 24], 4: [0, 7, 7, 16, 24]}
SPECIAL_RANK = 1


@dataclass(frozen=True)
class Case:
    preset: str
    aggregation: str
    layout: str
    granularity: str
    backend: str

    @property
    def id(self) -> str:
        return f"{self.preset}-{self.aggregation}-{self.layout}-{self.granularity}-{self.backend}"


CASES = [
    Case(*values)
    for values in itertools.product(PRESETS, AGGREGATIONS, LAYOUTS, GRANULARITIES, BACKENDS)
]

_PLANS: dict[str, SearchPlan] = {}


def plan_for(preset: str) -> SearchPlan:
    if preset not in _PLANS:
        _PLANS[preset] = SearchPlan.from_config(ClipSearchConfig.from_preset(preset))
    return _PLANS[preset]


class CountingReduce:
    """Wraps a reduce and counts its calls."""

    def __init__(self, reduce):
        self.reduce = reduce
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.reduce(x)


# ----------------------------------------------------------------------------------- data


def slice_bounds(layout: str, world_size: int) -> list[int]:
    if layout == "even":
        return [BATCH * r // world_size for r in range(world_size + 1)]
    if layout == "uneven-empty-rank":
        return list(UNEVEN_BOUNDS[world_size])
    return list(NO_ROWS_BOUNDS[world_size])


def random_batch(seed: int, bounds: list[int], empty_rank: int | None) -> dict:
    """float64 off-policy batch: per-sequence advantages of both signs (and some zeros), stale
    log-probs drifting with the advantage's sign, response masks with prompt offsets and padding
    that holds NaN / huge values (which must stay out of loss, bounds and gradients)."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    start = torch.randint(0, 4, (BATCH,), generator=g)
    length = torch.randint(1, TOKENS - 3, (BATCH,), generator=g)
    pos = torch.arange(TOKENS)
    mask = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    mask[torch.randperm(BATCH, generator=g)[:2]] = False  # a couple of empty sequences
    if empty_rank is not None:
        mask[bounds[empty_rank] : bounds[empty_rank + 1]] = False
    advantages = torch.randn(BATCH, **f64) - 0.15
    advantages[torch.randperm(BATCH, generator=g)[:2]] = 0.0
    logp_old = -torch.empty(BATCH, TOKENS, dtype=torch.float64).exponential_(1.0, generator=g) * 2
    drift = torch.where(advantages > 0, 0.35, -0.2)[:, None]
    logp_base = logp_old + drift + 0.3 * torch.randn(BATCH, TOKENS, **f64)
    # Garbage at padding: NaN in the old log-probs, +50 in the new ones (log-ratio clamp active).
    logp_old = torch.where(mask, logp_old, float("nan"))
    logp_base = torch.where(mask, logp_base, 50.0)
    return {
        "seed": seed,
        "logp_old": logp_old,
        "logp_base": logp_base,
        "features": torch.randn(BATCH, TOKENS, FEATURES, **f64),
        "theta": 0.05 * torch.randn(FEATURES, **f64),
        "advantages": advantages,
        "mask": mask,
        "bounds": bounds,
    }


def occupied_ranks(data: dict) -> list[int]:
    """Ranks whose slice holds at least one response token."""
    b = data["bounds"]
    return [r for r in range(len(b) - 1) if bool(data["mask"][b[r] : b[r + 1]].any())]


def search_on_rows(data: dict, case: Case, lo: int, hi: int) -> tuple[float, float, int]:
    """(c_low, c_high, steps) of a search over rows [lo, hi) alone (torch statistics)."""
    plan = plan_for(case.preset)
    with torch.no_grad():
        logp = data["logp_base"][lo:hi] + data["features"][lo:hi] @ data["theta"]
        ratio, log_ratio = importance_ratio(logp, data["logp_old"][lo:hi])
        adv = data["advantages"][lo:hi, None].expand_as(ratio).to(ratio.dtype)
        stats, _ = contribution_stats(ratio, log_ratio, adv, data["mask"][lo:hi], plan, "torch")
        d = choose_bounds(stats, plan)
    return float(d.c_low), float(d.c_high), int(d.steps)


def build_case_data(case: Case, world_size: int) -> tuple[dict, dict]:
    """A fresh batch for ``case`` on which the single-process search stops strictly inside its
    path, and (when two or more ranks hold response tokens) some rank searching alone would
    choose other bounds: so equal bounds mean something. Returns it with the single-process
    result."""
    bounds = slice_bounds(case.layout, world_size)
    empty_rank = SPECIAL_RANK if case.layout == "uneven-empty-rank" else None
    max_steps = plan_for(case.preset).max_steps
    base_seed = zlib.crc32(f"{world_size}/{case.id}".encode())
    for attempt in range(2000):
        data = random_batch(base_seed * 10000 + attempt, bounds, empty_rank)
        c_low, c_high, steps = search_on_rows(data, case, 0, BATCH)
        if not 0 < steps < max_steps:
            continue
        local = [search_on_rows(data, case, lo, hi)[:2] for lo, hi in zip(bounds[:-1], bounds[1:])]
        occupied = occupied_ranks(data)
        if len(occupied) < 2 or any(local[r] != (c_low, c_high) for r in occupied):
            data["local_bounds"] = local
            return data, single_process(data, case)
    raise AssertionError(f"{case.id}: no batch made the search stop inside its path")


# ------------------------------------------------------------------------- computations


def _floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


def single_process(data: dict, case: Case) -> dict:
    """The whole batch in one process: one ``bapo_loss`` call with an identity reduce."""
    plan = plan_for(case.preset)
    theta = data["theta"].clone().requires_grad_(True)
    logp_new = data["logp_base"] + data["features"] @ theta
    logp_new.retain_grad()
    counter = CountingReduce(identity_reduce)
    normalizer = loss_normalizer(data["mask"], case.aggregation)
    loss, metrics = bapo_loss(
        logp_new,
        data["logp_old"],
        data["advantages"],
        data["mask"],
        plan=plan,
        normalizer=normalizer,
        aggregation=case.aggregation,
        reduce=counter,
        backend=case.backend,
    )
    loss.backward()
    return {
        "loss": loss.detach(),
        "theta_grad": theta.grad.detach().clone(),
        "logp_grad": logp_new.grad.detach().clone(),
        "normalizer": float(normalizer),
        "metrics": _floats(metrics),
        "steps": int(metrics["bapo/search_steps"]),
        "reduce_calls": counter.calls,
    }


def rank_part(data: dict, case: Case, rank: int) -> dict:
    """This rank's share of the step, with real collectives (runs inside a worker)."""
    plan = plan_for(case.preset)
    lo, hi = data["bounds"][rank], data["bounds"][rank + 1]
    logp_old, logp_base = data["logp_old"][lo:hi], data["logp_base"][lo:hi]
    features, advantages = data["features"][lo:hi], data["advantages"][lo:hi]
    mask = data["mask"][lo:hi]
    theta = data["theta"].clone().requires_grad_(True)
    counter = CountingReduce(all_reduce_sum())
    n = hi - lo
    if case.granularity == "micro-batch":
        micro = [slice(0, n)]
    else:  # two micro-batches (one may be empty or hold no response token)
        micro = [slice(0, n // 2), slice(n // 2, n)]

    # The global normalizer: local parts summed over micro-batches, then one all-reduce.
    normalizer = sum(loss_normalizer(mask[mb], case.aggregation) for mb in micro)
    normalizer = torch.as_tensor(normalizer, dtype=torch.float64).clone()
    dist.all_reduce(normalizer, op=dist.ReduceOp.SUM)

    decision = None
    step_reduce_calls = 0
    step_extremes = None
    if case.granularity == "step":
        stats = None
        extremes = torch.tensor([math.inf, -math.inf], dtype=torch.float64)
        with torch.no_grad():
            for mb in micro:
                logp = logp_base[mb] + features[mb] @ theta
                ratio, log_ratio = importance_ratio(logp, logp_old[mb])
                adv = advantages[mb][:, None].expand_as(ratio).to(ratio.dtype)
                s, e = contribution_stats(ratio, log_ratio, adv, mask[mb], plan, case.backend)
                stats = s if stats is None else stats + s
                extremes = torch.stack([extremes[0].minimum(e[0]), extremes[1].maximum(e[1])])
        decision = choose_bounds(counter(stats), plan)
        step_reduce_calls = counter.calls
        step_extremes = extremes

    loss_calls, losses, logp_grads, metrics_per_call = [], [], [], []
    for mb in micro:
        logp_new = logp_base[mb] + features[mb] @ theta
        logp_new.retain_grad()
        before = counter.calls
        loss, metrics = bapo_loss(
            logp_new,
            logp_old[mb],
            advantages[mb],
            mask[mb],
            plan=plan,
            normalizer=normalizer,
            aggregation=case.aggregation,
            reduce=counter,
            decision=decision,
            backend=case.backend,
        )
        loss_calls.append(counter.calls - before)
        loss.backward()  # gradients of theta accumulate over micro-batches
        losses.append(loss.detach())
        logp_grads.append(logp_new.grad.detach().clone())
        metrics_per_call.append(_floats(metrics))

    theta_grad = theta.grad.detach().clone()
    theta_grad_all = theta_grad.clone()
    dist.all_reduce(theta_grad_all, op=dist.ReduceOp.SUM)  # the data-parallel gradient sum

    metrics = dict(metrics_per_call[0])
    if case.granularity == "step":
        metrics.update(_floats(decision.metrics))
        metrics["bapo/ratio_min_local"], metrics["bapo/ratio_max_local"] = step_extremes.tolist()
    return {
        "loss": torch.stack(losses).sum(),
        "theta_grad": theta_grad,
        "theta_grad_all_reduced": theta_grad_all,
        "logp_grad": torch.cat(logp_grads),
        "normalizer": float(normalizer),
        "metrics": metrics,
        "metrics_per_call": metrics_per_call,
        "loss_reduce_calls": loss_calls,
        "step_reduce_calls": step_reduce_calls,
        "steps": int(metrics["bapo/search_steps"]),
    }
