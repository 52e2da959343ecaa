r"""DAPO's overlong reward shaping and overlong filtering (pure functions).

With the response length cap L_max, the buffer L_buffer and the penalty factor f, a response of
L tokens gets

    penalty(L) = f * min(0, (L_max - L_buffer - L) / L_buffer)

added to its reward before the group advantages are computed: nothing up to L_max - L_buffer,
then a linear fall to -f at the cap. Filtering instead keeps the responses the engine cut off at
the cap out of training (their group's advantages are still computed with them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlongShaping:
    """The shaped rewards of a batch of groups and what the shaping did ([groups, n] each)."""

    rewards: torch.Tensor
    """Rewards plus the penalty (float64)."""
    penalty: torch.Tensor
    """The penalty added to each reward (<= 0, float64)."""
    trained: torch.Tensor
    """Samples that train: all of them, or with the filter those not cut off at the cap."""


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """``penalty(L)`` (module docstring) of every response length in ``lengths``, float64;
    zeros when ``buffer_length`` is 0."""
    lengths = lengths.to(torch.float64)
    if buffer_length <= 0:
        return torch.zeros_like(lengths)
    excess = (lengths - (max_length - buffer_length)) / buffer_length
    return -penalty_factor * excess.clamp(min=0)


def shape_overlong(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float,
    filter_truncated: bool,
) -> OverlongShaping:
    """The penalty on ``rewards`` [groups, n] of responses of ``lengths`` tokens, and with
    ``filter_truncated`` the ``truncated`` ones (cut off at the cap) left out of training. With
    neither, the rewards come back as they were, bit for bit."""
    if not rewards.shape == lengths.shape == truncated.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, lengths {tuple(lengths.shape)} and truncated "
            f"{tuple(truncated.shape)} must have the same [groups, n] shape"
        )
    penalty = overlong_penalty(lengths, max_length, buffer_length, penalty_factor)
    shaped = rewards + penalty if buffer_length > 0 and penalty_factor > 0 else rewards
    trained = ~truncated.bool() if filter_truncated else torch.ones_like(truncated, dtype=bool)
    return OverlongShaping(rewards=shaped, penalty=penalty, trained=trained)
