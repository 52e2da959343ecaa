"""The layout of the bound search's statistics vector: per bucket of each side's candidate grid
three channels (|A|*r, |A|, the token count), then three totals (:mod:`bapo_megatron.algo.
contributions` fills it, :mod:`bapo_megatron.algo.bound_search` reads it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bapo_megatron.algo.search_plan import SearchPlan

CHANNELS = 3  # |A|*r, |A|, count
EXTRAS = 3  # zero-advantage token count, sum of r, sum of k3 KL


@dataclass(frozen=True)
class StatsLayout:
    """Where each quantity sits in the flat statistics vector of a :class:`SearchPlan`."""

    num_high: int  # c_high candidates
    num_low: int  # c_low candidates

    @classmethod
    def of(cls, plan: SearchPlan) -> StatsLayout:
        return cls(num_high=len(plan.c_high_values), num_low=len(plan.c_low_values))

    @property
    def positive_buckets(self) -> int:
        return self.num_high + 1

    @property
    def negative_buckets(self) -> int:
        # num_low + 1 ordinary buckets, plus one for dual-clipped tokens (r > C).
        return self.num_low + 2

    @property
    def row(self) -> int:
        return self.positive_buckets + self.negative_buckets

    @property
    def size(self) -> int:
        return CHANNELS * self.row + EXTRAS

    def split(self, stats: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a (reduced) statistics vector by name."""
        rows = stats[: CHANNELS * self.row].view(CHANNELS, self.row)
        pos, neg = rows[:, : self.positive_buckets], rows[:, self.positive_buckets :]
        extras = stats[CHANNELS * self.row :]
        return {
            "pos_weighted_ratio": pos[0],
            "pos_weight": pos[1],
            "pos_count": pos[2],
            "neg_weighted_ratio": neg[0],
            "neg_weight": neg[1],
            "neg_count": neg[2],
            "zero_count": extras[0],
            "ratio_sum": extras[1],
            "kl_sum": extras[2],
        }
