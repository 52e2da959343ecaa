"""DAPO's overlong penalty and filter (bapo_megatron/algo/overlong.py) against the piecewise
formula written out here in float64, on fresh random lengths."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.algo.overlong import overlong_penalty, shape_overlong


def reference_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    return -factor * (length - expected) / buffer


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("buffer, factor", [(4, 1.0), (16, 0.5), (32, 2.0)])
def test_the_penalty_is_the_piecewise_linear_formula(seed, buffer, factor):
    g = torch.Generator().manual_seed(seed)
    max_length = 32
    lengths = torch.randint(0, max_length + 1, (6, 5), generator=g)
    got = overlong_penalty(lengths, max_length, buffer, factor)
    assert got.dtype == torch.float64
    for (i, j), length in zip(
        torch.cartesian_prod(torch.arange(6), torch.arange(5)).tolist(),
        lengths.reshape(-1).tolist(),
    ):
        assert float(got[i, j]) == pytest.approx(
            reference_penalty(length, max_length, buffer, factor), rel=1e-15, abs=1e-15
        )
    assert float(overlong_penalty(torch.tensor([max_length]), max_length, buffer, factor)) == (
        pytest.approx(-factor)
    )


def test_shaping_adds_the_penalty_and_the_filter_marks_the_truncated():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(4, 3, generator=g, dtype=torch.float64)
    lengths = torch.tensor([[10, 30, 32], [5, 31, 32], [32, 32, 32], [1, 2, 3]])
    truncated = lengths == 32
    shaped = shape_overlong(
        rewards,
        lengths,
        truncated,
        max_length=32,
        buffer_length=8,
        penalty_factor=1.0,
        filter_truncated=True,
    )
    torch.testing.assert_close(shaped.rewards, rewards + overlong_penalty(lengths, 32, 8, 1.0))
    assert shaped.penalty[0].tolist() == pytest.approx([0.0, -6 / 8, -1.0])
    assert torch.equal(shaped.trained, ~truncated)


def test_neither_penalty_nor_filter_leaves_the_rewards_as_they_were():
    rewards = torch.rand(3, 4, dtype=torch.float64)
    lengths = torch.full((3, 4), 32)
    off = shape_overlong(
        rewards,
        lengths,
        lengths == 32,
        max_length=32,
        buffer_length=0,
        penalty_factor=1.0,
        filter_truncated=False,
    )
    assert off.rewards is rewards and off.trained.all() and off.penalty.eq(0).all()
    with pytest.raises(ValueError, match="same \\[groups, n\\] shape"):
        shape_overlong(
            rewards,
            lengths[:, :2],
            lengths == 32,
            max_length=32,
            buffer_length=4,
            penalty_factor=1.0,
            filter_truncated=False,
        )
