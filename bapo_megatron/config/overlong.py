"""Overlong responses: the soft length penalty on the reward and the option that keeps responses
cut off at the length cap out of the loss (docs/algorithm.md section 1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bapo_megatron.config.ranges import require_at_least


@dataclass(kw_only=True)
class OverlongConfig:
    """DAPO's soft overlong punishment and overlong filtering (``loss.overlong``)."""

    buffer_length: int = 0
    """L_buffer: the last this many tokens before the length cap L_max =
    ``rollout.max_new_tokens`` over which the reward falls linearly. A response of L tokens gets
    ``min(0, (L_max - L_buffer - L) / L_buffer) * penalty_factor`` added to its reward before the
    advantages are computed (0 up to L_max - L_buffer, -penalty_factor at the cap). 0: no
    penalty. Reported as ``overlong/penalty_mean`` and ``overlong/penalized_fraction``."""
    penalty_factor: float = 1.0
    """The penalty at the length cap (the reward a response reaching it loses)."""
    filter: bool = False
    """Keep the responses the engine stopped at the length cap (finish reason `length`) out of the
    loss, the clip search and the aggregation's counts; they still count in their group's
    advantage. Reported as ``overlong/filtered_fraction``."""

    def __post_init__(self) -> None:
        prefix = "loss.overlong"
        require_at_least(self.buffer_length, 0, f"{prefix}.buffer_length")
        if not (math.isfinite(self.penalty_factor) and self.penalty_factor >= 0):
            raise ValueError(
                f"{prefix}.penalty_factor must be a finite number >= 0, got {self.penalty_factor!r}"
            )

    @property
    def shapes_rewards(self) -> bool:
        """Whether the penalty changes any reward."""
        return self.buffer_length > 0 and self.penalty_factor > 0

    @property
    def enabled(self) -> bool:
        """Whether the penalty or the filter is on (and the ``overlong/*`` metrics are logged)."""
        return self.shapes_rewards or self.filter
