"""GRPO advantages against a float64 loop over groups."""

from __future__ import annotations

import statistics

import pytest
import torch

from bapo_megatron.algo.advantages import grpo_advantages, informative_groups


@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_a_per_group_float64_loop(normalize_std):
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(7, 5, generator=g) > 0.5).double() + 0.1 * torch.rand(7, 5, generator=g)
    rewards[2] = 1.0  # an all-equal group
    got = grpo_advantages(rewards, normalize_std=normalize_std)
    for row, values in enumerate(rewards.tolist()):
        mean = statistics.fmean(values)
        for col, value in enumerate(values):
            want = value - mean
            if normalize_std:
                want /= statistics.stdev(values) + 1e-6
            assert float(got[row, col]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert (got[2] == 0).all()
    assert informative_groups(rewards).tolist() == [row != 2 for row in range(7)]


def test_shapes_and_edge_cases():
    assert torch.equal(grpo_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))
    assert grpo_advantages(torch.tensor([[1, 0]])).dtype == torch.float64
    with pytest.raises(ValueError, match="rewards: expected shape"):
        grpo_advantages(torch.zeros(4))
