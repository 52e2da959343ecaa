r"""The BAPO policy loss (arXiv 2510.18927, with the authors' code as a named mode).

For every response token t (mask m_t = 1):

    r_t = exp(clamp(log pi_theta(y_t) - log pi_old(y_t), -20, 20))
    L_t = -min(r_t A_t, clip(r_t, c_low, c_high) A_t)                    (Eq. 3 / 8)

so for A_t > 0 only c_high acts (no gradient iff r_t > c_high) and for A_t < 0 only c_low acts
(no gradient iff r_t < c_low). The optional dual clip C caps negative-advantage tokens:
L_t = |A_t| min(max(r_t, c_low), C). An optional importance weight w_t multiplies A_t, and an
optional entropy bonus c * H is subtracted after aggregation (docs/algorithm.md section 2.4).

BAPO chooses (c_low, c_high) per update so that the positive contribution
rho = P / (P + N) reaches rho0 (Algorithm 1), moving the bounds along a fixed grid; see
:mod:`bapo_megatron.algo.bound_search`. Fixed-clip GRPO and clip-higher are the same function
with empty search ranges.

Aggregation (the paper leaves it open): `token-mean` divides the sum over the step's tokens by
the step's global response-token count, so one optimizer step's gradient does not depend on
how it is split into micro-batches or ranks; the `seq-mean-*` modes divide by the global count
of sequences with at least one response token. The caller reduces that count once per step
(:func:`loss_normalizer` gives the local part) and passes it in.
"""

from __future__ import annotations

import math

import torch

from bapo_megatron.algo.bound_search import BoundDecision, choose_bounds
from bapo_megatron.algo.contributions import Backend, contribution_stats
from bapo_megatron.algo.reduction import ReduceFn, identity_reduce
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import AGGREGATIONS

LOG_RATIO_CLAMP = 20.0


def importance_ratio(
    logp_new: torch.Tensor, logp_old: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, log r)`` with log r clamped to [-20, 20]; at least float32 whatever the inputs."""
    dtype = torch.promote_types(torch.promote_types(logp_new.dtype, logp_old.dtype), torch.float32)
    log_ratio = (logp_new.to(dtype) - logp_old.to(dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp(), log_ratio


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    c_low: torch.Tensor | float,
    c_high: torch.Tensor | float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token L_t = -A_t * clipped r_t; clipped tokens carry zero gradient (ties unclipped)."""
    # clamp() passes gradient where min <= r <= max, so r == c_high still counts as unclipped,
    # matching the search's P(c_high) = sum over r <= c_high.
    negative_side = ratio.clamp(min=c_low)
    if dual_clip is not None:
        negative_side = negative_side.clamp(max=dual_clip)
    clipped = torch.where(advantages > 0, ratio.clamp(max=c_high), negative_side)
    return -advantages * clipped


def loss_normalizer(
    mask: torch.Tensor, aggregation: str, sequence_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """This batch's share of the aggregation denominator (float64), to be summed over the step.
    ``sequence_ids`` as for :func:`aggregate`."""
    _check_aggregation(aggregation)
    mask = mask.bool()
    if aggregation == "token-mean":
        return mask.sum().to(torch.float64)
    if sequence_ids is not None:
        return torch.unique(sequence_ids[mask]).numel() * torch.ones((), dtype=torch.float64)
    return (mask.sum(-1) > 0).sum().to(torch.float64)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    normalizer: torch.Tensor | float,
    sequence_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum this batch's part of the step's loss and divide by the step's global ``normalizer``.

    ``per_token`` and ``mask`` are [batch, tokens]; a zero normalizer (no response token anywhere)
    gives a zero loss that still depends on the inputs, so every rank runs the same backward.
    ``sequence_ids`` ([batch, tokens] int, ids from 0): the sequence each token belongs to where
    a row holds several (packed rows); None: each row is one sequence.
    """
    _check_aggregation(aggregation)
    mask = mask.bool()
    masked = torch.where(mask, per_token, 0.0)  # where, not *: NaN at padding must not leak
    if aggregation == "seq-mean-token-mean" and sequence_ids is not None:
        ids = sequence_ids.reshape(-1).to(per_token.device)
        segments = int(ids.max()) + 1 if ids.numel() else 0
        sums = masked.new_zeros(segments).index_add(0, ids, masked.reshape(-1))
        counts = masked.new_zeros(segments).index_add(0, ids, mask.reshape(-1).to(masked.dtype))
        total = (sums / counts.clamp(min=1)).sum()
    elif aggregation == "seq-mean-token-mean":
        total = (masked.sum(-1) / mask.sum(-1).clamp(min=1).to(per_token.dtype)).sum()
    else:  # token-mean and seq-mean-token-sum share the numerator
        total = masked.sum()
    normalizer = torch.as_tensor(normalizer, device=per_token.device)
    return total / normalizer.clamp(min=1).to(per_token.dtype)


def truncated_importance_weights(
    recomputed_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float
) -> torch.Tensor:
    """min(exp(recomputed - behaviour), cap), detached: corrects engine/trainer mismatch when the
    ratio is taken against log-probs recomputed by the actor."""
    if not cap > 0:
        raise ValueError(f"truncated importance weight cap must be > 0, got {cap}")
    diff = (recomputed_logp.detach() - behaviour_logp.detach()).clamp(
        -LOG_RATIO_CLAMP, math.log(cap)
    )
    return diff.exp()


def bapo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    plan: SearchPlan,
    normalizer: torch.Tensor | float,
    aggregation: str = "token-mean",
    reduce: ReduceFn = identity_reduce,
    is_weights: torch.Tensor | None = None,
    decision: BoundDecision | None = None,
    check_inputs: bool = True,
    backend: Backend = "auto",
    sequence_ids: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The BAPO loss of one micro-batch, with its own bound search unless ``decision`` is given.

    Args:
        logp_new: [batch, tokens] log-probs of the taken tokens under the current policy (grad).
        logp_old: [batch, tokens] log-probs the ratio is taken against (behaviour or recomputed).
        advantages: [batch, tokens] or [batch] (copied to every token).
        mask: [batch, tokens] response-token mask (bool or 0/1).
        plan: candidate grids and path of the search (:meth:`SearchPlan.from_config`).
        normalizer: the step's global aggregation denominator (see :func:`loss_normalizer`).
        aggregation: `token-mean`, `seq-mean-token-mean` or `seq-mean-token-sum`.
        reduce: sums a tensor over the data x context parallel group (called once).
        is_weights: optional [batch, tokens] truncated importance weights (detached).
        decision: bounds decided elsewhere (granularity `step`): no search here, no reduce.
        check_inputs: validate shapes and finiteness (one host sync).
        backend: statistics backend, see :func:`contribution_stats`.
        sequence_ids: [batch, tokens] sequence of each token where a row packs several
            (the `seq-mean-*` aggregations average per sequence); None: one per row.
        entropy: [batch, tokens] full-vocabulary entropy of each token's distribution (grad),
            needed when ``entropy_coef`` > 0.
        entropy_coef: weight c of the entropy bonus: the loss is the policy loss minus c times
            the entropy aggregated like it (same aggregation, same normalizer). The bonus stays
            out of the search's statistics.

    Returns:
        ``(loss, metrics)``: the scalar loss and 0-dim metric tensors. `bapo/*` metrics from the
        search are global (over the reduced batch); `bapo/ratio_min_local` and
        `bapo/ratio_max_local` cover this rank's tokens only; with an entropy bonus,
        `actor/entropy_bonus` is this batch's part of it (summed over the step's micro-batches
        and ranks it is the bonus subtracted from the step's loss).
    """
    if check_inputs:
        check_loss_inputs(logp_new, logp_old, advantages, mask, is_weights)
    _check_aggregation(aggregation)
    mask = mask.bool()
    ratio, log_ratio = importance_ratio(logp_new, logp_old)
    advantages = _effective_advantages(advantages, is_weights, ratio)

    metrics: dict[str, torch.Tensor] = {}
    if decision is None:
        with torch.no_grad():
            stats, extremes = contribution_stats(ratio, log_ratio, advantages, mask, plan, backend)
            decision = choose_bounds(reduce(stats), plan)
        metrics["bapo/ratio_min_local"], metrics["bapo/ratio_max_local"] = extremes[0], extremes[1]
    per_token = clipped_surrogate(
        ratio, advantages, decision.c_low, decision.c_high, plan.config.dual_clip
    )
    loss = aggregate(per_token, mask, aggregation, normalizer, sequence_ids)
    metrics = {
        **decision.metrics,
        "bapo/c_low": decision.c_low,
        "bapo/c_high": decision.c_high,
        **metrics,
    }
    if entropy_coef:
        bonus = entropy_coef * aggregate(
            _checked_entropy(entropy, logp_new), mask, aggregation, normalizer, sequence_ids
        )
        loss = loss - bonus
        metrics["actor/entropy_bonus"] = bonus.detach().double()
    return loss, metrics


def _checked_entropy(entropy: torch.Tensor | None, logp_new: torch.Tensor) -> torch.Tensor:
    if entropy is None:
        raise ValueError("entropy: bapo_loss needs the token entropies when entropy_coef > 0")
    if entropy.shape != logp_new.shape:
        raise ValueError(
            f"entropy: shape {tuple(entropy.shape)} does not match logp_new {tuple(logp_new.shape)}"
        )
    return entropy


def search_statistics(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    plan: SearchPlan,
    is_weights: torch.Tensor | None = None,
    check_inputs: bool = True,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The local statistics ``bapo_loss`` would build for this micro-batch, without the loss.

    For granularity `step`: sum the results over the step's micro-batches, reduce once,
    :func:`choose_bounds`, then call ``bapo_loss(..., decision=...)`` per micro-batch. Arguments
    as for :func:`bapo_loss`; returns ``(stats, [min r, max r])`` as
    :func:`contribution_stats` does.
    """
    if check_inputs:
        check_loss_inputs(logp_new, logp_old, advantages, mask, is_weights)
    with torch.no_grad():
        ratio, log_ratio = importance_ratio(logp_new.detach(), logp_old)
        advantages = _effective_advantages(advantages, is_weights, ratio)
        return contribution_stats(ratio, log_ratio, advantages, mask.bool(), plan, backend)


def _effective_advantages(
    advantages: torch.Tensor, is_weights: torch.Tensor | None, ratio: torch.Tensor
) -> torch.Tensor:
    """Per-token A * w in the ratio's dtype, detached (per-sequence A copied to every token)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(ratio)
    advantages = advantages.detach().to(ratio.dtype)
    if is_weights is not None:
        advantages = advantages * is_weights.detach().to(ratio.dtype)
    return advantages


def check_loss_inputs(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the input for wrong shapes, dtypes or non-finite values at
    response tokens (values under mask = 0 are ignored, as padding may hold anything)."""
    if logp_new.dim() != 2:
        raise ValueError(f"logp_new: expected shape [batch, tokens], got {tuple(logp_new.shape)}")
    shape = logp_new.shape
    named = {"logp_old": logp_old, "mask": mask}
    if is_weights is not None:
        named["is_weights"] = is_weights
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not match logp_new {tuple(shape)}"
            )
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages: shape {tuple(advantages.shape)} must be {tuple(shape)} "
            f"or {tuple(shape[:1])}"
        )
    for name, tensor in (
        ("logp_new", logp_new),
        ("logp_old", logp_old),
        ("advantages", advantages),
    ):
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask: expected bool or 0/1 values")
    mask = mask.bool()
    values = {"logp_new": logp_new.detach(), "logp_old": logp_old, "advantages": advantages}
    if is_weights is not None:
        values["is_weights"] = is_weights
    # Fast path: one sum is non-finite iff some input is (overflow aside), and costs one sync.
    total = logp_new.detach() + logp_old
    total = total + (advantages if advantages.shape == shape else advantages[:, None])
    if is_weights is not None:
        total = total + is_weights
    if not bool((~torch.isfinite(total) & mask).any()):
        return
    for name, tensor in values.items():
        token_mask = mask if tensor.shape == shape else mask.any(-1)
        bad = ~torch.isfinite(tensor) & token_mask
        count = int(bad.sum())
        if count:
            where = bad.nonzero()[0].tolist()
            raise ValueError(
                f"{name}: {count} non-finite value(s) (nan/inf) at response tokens, "
                f"first at {where}"
            )


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}")
