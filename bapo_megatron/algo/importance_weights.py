r"""Off-policy corrections: the importance weight that multiplies each response token's advantage
when the ratio is taken against log-probs the actor recomputed at the start of the rollout step
(the *proximal* policy of the decoupled objective) while the tokens were sampled by the engine's
*behaviour* policy (docs/algorithm.md section 6).

With ``d_t = log pi_proximal(y_t) - log pi_behaviour(y_t)`` and the cap ``C``:

- ``token-truncate``:    w_t = min(exp(d_t), C)
- ``sequence-truncate``: w_t = min(exp(D), C) for every token of a sequence, D = sum_t d_t over
  its response tokens
- ``sequence-mask``:     w_t = 1 if 1/C <= exp(D) <= C else 0, for every token of the sequence

Weights are 0 off the response. ``token-truncate`` is computed exactly as the trainer always did
(in the log-probs' dtype); the sequence sums are taken in float64, since a long response adds
thousands of small differences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch

from bapo_megatron.config.run import OffPolicyCorrection

WEIGHTED_CORRECTIONS = tuple(c for c in get_args(OffPolicyCorrection) if c != "none")
"""The corrections that put a weight on the loss (all but ``none``)."""


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
    """Sequences whose weight is 0 because they were masked (``sequence-mask`` only)."""


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
    cap: float,
) -> ImportanceWeights:
    """The ``correction``'s weights (module docstring) of the [n, s] proximal log-probs
    ``recomputed`` against the ``behaviour`` ones on the ``response_mask`` tokens, capped by
    ``cap``; values off the response are ignored (they may be anything, even inf)."""
    if correction not in WEIGHTED_CORRECTIONS:
        raise ValueError(
            f"off-policy correction must be one of {list(WEIGHTED_CORRECTIONS)}, got {correction!r}"
        )
    if not cap > 0:
        raise ValueError(f"off-policy correction cap must be > 0, got {cap!r}")
    if recomputed.shape != response_mask.shape or behaviour.shape != response_mask.shape:
        raise ValueError(
            f"recomputed {tuple(recomputed.shape)}, behaviour {tuple(behaviour.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have the same [n, s] shape"
        )
    mask = response_mask
    has_tokens = mask.any(-1)
    if correction == "token-truncate":
        # today's expression, kept as it was: runs that used loss.truncated_is_cap stay bitwise
        uncapped = torch.exp(recomputed - behaviour)
        weights = torch.where(mask, uncapped.clamp(max=cap), 0.0)
        clipped = mask & (uncapped > cap)
        masked = torch.zeros_like(has_tokens)
    else:
        log_weight = torch.where(mask, recomputed.double() - behaviour.double(), 0.0).sum(-1)
        log_cap = math.log(cap)
        if correction == "sequence-truncate":
            truncated = log_weight > log_cap
            per_sequence = torch.where(truncated, cap, torch.exp(log_weight))
            masked = torch.zeros_like(has_tokens)
        else:  # sequence-mask: two-sided, a sequence far below 1 is as far off-policy
            masked = has_tokens & ((log_weight > log_cap) | (log_weight < -log_cap))
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
    )
    return ImportanceWeights(weights, statistics)
