"""The fixed path of bound pairs a clip-bound search can walk (docs/algorithm.md section 4).

Both schedules walk a path that does not depend on the data: a list of (c_low index, c_high index)
positions on two candidate grids. Position s is reached after s moves. The data only decides
where along the path the walk stops, which is what lets one histogram pass and one collective
serve the whole search.

Candidate values are ``start + k * step`` for integer k (rounded to 12 decimals so that
0.6 + 15 * 0.02 is 0.9, not 0.8999999999999999); the float accumulation of Algorithm 1 as written
would stop at 0.88.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bapo_megatron.config import ClipSearchConfig

# A range whose length is within this many steps of an integer counts as that integer.
_STEP_TOLERANCE = 1e-9


def whole_steps(start: float, stop: float, step: float) -> int:
    """Number of full steps of size ``step`` from ``start`` that stay <= ``stop``."""
    return math.floor((stop - start) / step + _STEP_TOLERANCE)


def clamped_steps(start: float, stop: float, step: float) -> int:
    """Number of steps to reach ``stop`` when the last one is clamped to it."""
    return max(0, math.ceil((stop - start) / step - _STEP_TOLERANCE))


def candidate_values(start: float, stop: float, step: float, clamp_last: bool) -> list[float]:
    """The grid of one bound: whole steps only (`paper`) or with a clamped last step
    (`reference`)."""
    count = clamped_steps(start, stop, step) if clamp_last else whole_steps(start, stop, step)
    return [min(round(start + k * step, 12), stop) for k in range(count + 1)]


@dataclass(frozen=True)
class SearchPlan:
    """Candidate grids and the walk order for one :class:`ClipSearchConfig`.

    ``c_low_values`` / ``c_high_values`` are the sorted candidates; ``path`` lists, for every
    position s = 0..len(path)-1, the indices (into those grids) of the bounds after s moves.
    """

    config: ClipSearchConfig
    c_low_values: tuple[float, ...]
    c_high_values: tuple[float, ...]
    path: tuple[tuple[int, int], ...]
    _device_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(cls, config: ClipSearchConfig) -> SearchPlan:
        clamp = config.schedule == "reference"
        lows = candidate_values(config.c_low_start, config.c_low_max, config.c_low_step, clamp)
        highs = candidate_values(config.c_high_start, config.c_high_max, config.c_high_step, clamp)
        last_low, last_high = len(lows) - 1, len(highs) - 1
        if config.schedule == "paper":
            # Algorithm 1: the loop runs only while c_low can still take a whole step, then moves
            # c_high while it fits, else c_low. So c_high walks to its max first, then c_low; and
            # with an empty c_low range nothing moves at all (kept as the paper states it).
            if last_low == 0:
                path = [(0, 0)]
            else:
                path = [(0, j) for j in range(last_high + 1)]
                path += [(k, last_high) for k in range(1, last_low + 1)]
        else:
            # The authors' code: c_low to its max first, then c_high.
            path = [(k, 0) for k in range(last_low + 1)]
            path += [(last_low, j) for j in range(1, last_high + 1)]
        return cls(
            config=config, c_low_values=tuple(lows), c_high_values=tuple(highs), path=tuple(path)
        )

    @property
    def max_steps(self) -> int:
        """Moves needed to exhaust both ranges."""
        return len(self.path) - 1

    @property
    def is_fixed(self) -> bool:
        """True when the bounds can never move (fixed-clip baselines)."""
        return len(self.path) == 1

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Grids (float64) and path indices (int64) on ``device``, built once per device."""
        key = str(device)
        cached = self._device_cache.get(key)
        if cached is None:
            lo_idx, hi_idx = zip(*self.path)
            cached = {
                "c_low": torch.tensor(self.c_low_values, dtype=torch.float64, device=device),
                "c_high": torch.tensor(self.c_high_values, dtype=torch.float64, device=device),
                "path_low": torch.tensor(lo_idx, dtype=torch.int64, device=device),
                "path_high": torch.tensor(hi_idx, dtype=torch.int64, device=device),
            }
            self._device_cache[key] = cached
        return cached
