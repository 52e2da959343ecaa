"""The last lines of a run on the console: what RL did (reward at the start and the end), what
BAPO did (how often the bounds moved off their starting values, the mean c_high) and what it
cost (wall time, peak memory), so that the figures a README quotes come from the program."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field


def peak_memory_gb() -> float:
    """Peak resident memory of this process so far, in GB (10^9 bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def bounds_moved(metrics: dict[str, float], c_low: float, c_high: float) -> bool:
    """Whether a step's ``bapo/c_low`` / ``bapo/c_high`` left (c_low, c_high); the bounds are
    built as start + k x step, so a difference below 1e-9 is rounding (0.8 logs as 0.79999...)."""
    return abs(metrics["bapo/c_low"] - c_low) > 1e-9 or abs(metrics["bapo/c_high"] - c_high) > 1e-9


@dataclass
class RunSummary:
    """Accumulates a run's rollout-step rewards and optimizer-step bounds; :meth:`lines` says
    what they add up to. ``c_low`` / ``c_high``: the bounds the search starts from."""

    c_low: float
    c_high: float
    started: float = field(default_factory=time.perf_counter)
    rewards: list[float] = field(default_factory=list)
    updates: int = 0
    moved: int = 0
    below_target: int = 0
    moved_below_target: int = 0
    c_high_sum: float = 0.0

    def add_update(self, metrics: dict[str, float], rho0: float | None) -> None:
        """One optimizer step's metrics (``bapo/c_low``, ``bapo/c_high``, ``bapo/rho_before``);
        ``rho0``: the search's target share (None: no target, a fixed clip or a ratio)."""
        if "bapo/c_high" not in metrics:
            return
        self.updates += 1
        moved = bounds_moved(metrics, self.c_low, self.c_high)
        self.moved += moved
        self.c_high_sum += metrics["bapo/c_high"]
        informative = (
            metrics.get("bapo/positive_contribution", 0.0)
            + metrics.get("bapo/negative_contribution", 0.0)
            > 0
        )
        if rho0 is not None and informative and metrics["bapo/rho_before"] < rho0:
            self.below_target += 1
            self.moved_below_target += moved

    def lines(self, rho0: float | None) -> list[str]:
        """The summary lines (nothing about rewards before the first rollout step)."""
        out = []
        if self.rewards:
            window = max(1, min(10, len(self.rewards) // 2))
            first, last = self.rewards[:window], self.rewards[-window:]
            out.append(
                f"mean reward of the first {window} rollout steps {sum(first) / window:.3f}, "
                f"of the last {window} {sum(last) / window:.3f}"
            )
        if self.updates:
            line = (
                f"bounds moved off {self.c_low:g}/{self.c_high:g} in {self.moved}/{self.updates} "
                f"optimizer steps ({self.moved / self.updates:.0%})"
            )
            if rho0 is not None:
                line += (
                    f", in {self.moved_below_target}/{self.below_target} of those with rho before "
                    f"the search < {rho0:g}"
                )
            out.append(line + f"; mean c_high {self.c_high_sum / self.updates:.3f}")
        wall = time.perf_counter() - self.started
        out.append(
            f"wall time {int(wall // 60)} min {wall % 60:.0f} s, "
            f"peak memory {peak_memory_gb():.2f} GB (this process)"
        )
        return out
