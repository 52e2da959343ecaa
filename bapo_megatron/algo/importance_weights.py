r"""Off-policy corrections: the importance weight that multiplies each response token's advantage
when the ratio is taken against log-probs the actor recomputed at the start of the rollout step
(the *proximal* policy of the decoupled objective) while the tokens were sampled by the engine's
*behaviour* policy (docs/algorithm.md section 6).

With ``d_t = log pi_proximal(y_t) - log pi_behaviour(y_t)`` and the cap ``C``:

- ``token-truncate``:    w_t = min(exp(d_t), C)
- ``sequence-truncate``: w_t = min(exp(D), C) for every token of a sequence, D = sum_t d_t over
  its response tokens
- ``sequence-mask``:     w_t = 1 if a <= exp(D) <= b else 0, for every token of the sequence
- ``token-mask``:        w_t = 1 if a <= exp(d_t) <= b else 0
- ``icepop``:            w_t = exp(d_t) if a <= exp(d_t) <= b else 0
- ``geometric-mask``:    w_t = 1 if a <= exp(D / n) <= b else 0, n the sequence's response tokens

The band [a, b] is the one given, or [1/C, C]; its ends are compared in log space (a = 0:
nothing is below it). Weights are 0 off the response. ``token-truncate`` is computed exactly
as the trainer always did (in the log-probs' dtype), and so are ``token-mask`` and ``icepop``;
the sequence sums are taken in float64, since a long response adds thousands of small
differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch

from bapo_megatron.config.run import OffPolicyCorrection

WEIGHTED_CORRECTIONS = tuple(c for c in get_args(OffPolicyCorrection) if c != "none")
"""The corrections that put a weight on the loss (all but ``none``)."""
MASKING = ("sequence-mask", "token-mask", "icepop", "geometric-mask")
"""The corrections that mask what lies outside a band."""


@dataclass(frozen=True)
class WeightStatistics:
    """Sums over one batch, to be added over mini-batches and data-parallel ranks before they are
    turned into shares (0-dimensional tensors)."""

    weight_sum: torch.Tensor
    """Sum of the weights over the response tokens (in the weights' dtype)."""
    tokens: torch.Tensor
    """Response tokens."""
    clipped_tokens: torch.Tensor
    """Response tokens whose weight the cap changed: truncated to it, or masked."""
    sequences: torch.Tensor
    """Sequences with at least one response token."""
    clipped_sequences: torch.Tensor
    """Sequences with at least one clipped token."""
    masked_sequences: torch.Tensor
    """Sequences all of whose response tokens were masked (weight 0 by a band)."""
    masked_tokens: torch.Tensor
    """Response tokens masked (weight 0 by a band; 0 for the truncations)."""


@dataclass(frozen=True)
class ImportanceWeights:
    """The weights of one batch and their statistics."""

    weights: torch.Tensor
    """[n, s] weights in the recomputed log-probs' dtype, 0 off the response."""
    statistics: WeightStatistics


def importance_weights(
    correction: OffPolicyCorrection,
    recomputed: torch.Tensor,
    behaviour: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float | None,
    band: tuple[float, float] | None = None,
) -> ImportanceWeights:
    """The ``correction``'s weights (module docstring) of the [n, s] proximal log-probs
    ``recomputed`` against the ``behaviour`` ones on the ``response_mask`` tokens, capped by
    ``cap``, the masks keeping ``band`` = (a, b) (None: [1/cap, cap]); values off the response
    are ignored (they may be anything, even inf)."""
    if correction not in WEIGHTED_CORRECTIONS:
        raise ValueError(
            f"off-policy correction must be one of {list(WEIGHTED_CORRECTIONS)}, got {correction!r}"
        )
    log_band = _log_band(correction, cap, band)
    if recomputed.shape != response_mask.shape or behaviour.shape != response_mask.shape:
        raise ValueError(
            f"recomputed {tuple(recomputed.shape)}, behaviour {tuple(behaviour.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same [n, s] shape"
        )
    mask = response_mask
    has_tokens = mask.any(-1)
    if correction in ("token-mask", "icepop"):
        weights, clipped = _token_mask(correction, recomputed, behaviour, mask, log_band)
        masked = has_tokens & ~(mask & ~clipped).any(-1)
    elif correction == "token-truncate":
        # today's expression, kept as it was: runs that used loss.truncated_is_cap stay bitwise
        uncapped = torch.exp(recomputed - behaviour)
        weights = torch.where(mask, uncapped.clamp(max=cap), 0.0)
        clipped = mask & (uncapped > cap)
        masked = torch.zeros_like(has_tokens)
    else:
        log_weight = torch.where(mask, recomputed.double() - behaviour.double(), 0.0).sum(-1)
        if correction == "sequence-truncate":
            log_cap = math.log(cap)
            truncated = log_weight > log_cap
            per_sequence = torch.where(truncated, cap, torch.exp(log_weight))
            masked = torch.zeros_like(has_tokens)
        else:  # the sequence masks: two-sided, a sequence far below 1 is as far off-policy
            if correction == "geometric-mask":
                log_weight = log_weight / mask.sum(-1).clamp(min=1)
            low, high = log_band
            masked = has_tokens & ((log_weight > high) | (log_weight < low))
            truncated = masked
            per_sequence = (~masked).double()
        weights = torch.where(mask, per_sequence.to(recomputed.dtype)[:, None], 0.0)
        clipped = mask & truncated[:, None]
    statistics = WeightStatistics(
        weight_sum=weights.sum(),
        tokens=mask.sum(),
        clipped_tokens=clipped.sum(),
        sequences=has_tokens.sum(),
        clipped_sequences=clipped.any(-1).sum(),
        masked_sequences=masked.sum(),
        masked_tokens=(clipped.sum() if correction in MASKING else torch.zeros_like(mask.sum())),
    )
    return ImportanceWeights(weights, statistics)


def _log_band(
    correction: str, cap: float | None, band: tuple[float, float] | None
) -> tuple[float, float]:
    """(log a, log b) of the masks' band, or (-log C, log C); checks the cap and the band."""
    if band is None or correction not in MASKING:
        if cap is None or not cap > 0:
            raise ValueError(f"off-policy correction cap must be > 0, got {cap!r}")
        # -log(C), not log(1/C): the bound sequence-mask always used, bit for bit
        return -math.log(cap), math.log(cap)
    low, high = band
    if not 0 <= low <= high:
        raise ValueError(f"off-policy correction band must have 0 <= a <= b, got {band!r}")
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def _token_mask(
    correction: str,
    recomputed: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    log_band: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and masked tokens of ``token-mask`` (1 inside the band) and ``icepop`` (the
    ratio inside the band), the log ratio taken in the log-probs' dtype."""
    gap = torch.where(mask, recomputed - behaviour, 0.0)
    low, high = log_band
    outside = mask & ((gap < low) | (gap > high))
    kept = gap.exp() if correction == "icepop" else torch.ones_like(gap)
    return torch.where(mask & ~outside, kept, 0.0), outside
