"""Token-budget micro-batches and data-parallel balancing: hand-worked cases, then properties on
hypothesis-drawn inputs (integer costs where exact sums matter, log-normal long tails otherwise)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_megatron.actor.token_budget import (
    BALANCE_TOLERANCE,
    balance_over_ranks,
    over_budget,
    sequence_cost,
    split_by_token_budget,
)

SETTINGS = settings(max_examples=80, deadline=None)
CAP = 8192  # response length cap of the long-tailed draws


def long_tailed(rng: random.Random, count: int) -> list[int]:
    """Log-normal lengths (median ~1.1k tokens), capped, with a quarter at the cap."""
    return [
        CAP if rng.random() < 0.25 else min(CAP, 1 + int(rng.lognormvariate(7, 1)))
        for _ in range(count)
    ]


def loads(costs, plan) -> list[float]:
    return [math.fsum(costs[s][i] for s, i in pairs) for pairs in plan]


def moved(plan) -> int:
    return sum(source != rank for rank, pairs in enumerate(plan) for source, _ in pairs)


# sequence_cost


def test_sequence_cost_is_dense_plus_causal_attention_flops():
    # float64 reference from the FLOP counts: 24 h^2 per token dense, 2 h L^2 attention.
    for length, hidden in [(0, 8), (1, 1), (6, 1), (1000, 64), (8192, 4096)]:
        flops = 24 * hidden**2 * length + 2 * hidden * length**2
        assert sequence_cost(length, hidden) == pytest.approx(flops / (24 * hidden**2), rel=1e-12)
    assert sequence_cost(6, 1) == 9.0
    # Attention matches the dense layers at L = 12 h.
    assert sequence_cost(12 * 64, 64) == 2 * 12 * 64


@pytest.mark.parametrize(
    "length, hidden, error, name",
    [
        (-1, 8, ValueError, "length"),
        (4, 0, ValueError, "hidden_size"),
        (2.0, 8, TypeError, "length"),
        (4, True, TypeError, "hidden_size"),
    ],
)
def test_sequence_cost_rejects_bad_input_by_name(length, hidden, error, name):
    with pytest.raises(error, match=name):
        sequence_cost(length, hidden)


# split_by_token_budget and over_budget


@pytest.mark.parametrize(
    "lengths, budget, expected",
    [
        # 6 -> new; 5 -> new; 4 -> new; 3 fills the 5's to 8; 2 fills the 6's to 8.
        ([5, 3, 4, 2, 6], 8, [[3, 4], [0, 1], [2]]),
        # Decreasing: the 3 opens the first micro-batch (first fit in index order would give
        # [[0, 1], [2]]).
        ([1, 2, 3], 3, [[2], [0, 1]]),
        # Equal lengths go by index; the second 1 does not fit beside 3 + 1.
        ([1, 3, 3, 1], 4, [[0, 1], [2, 3]]),
        # The over-long 10 is alone; even a zero-length sequence does not join it.
        ([10, 1, 1], 4, [[0], [1, 2]]),
        ([7, 0], 5, [[0], [1]]),
        ([0, 5], 5, [[0, 1]]),
        ([4], 4, [[0]]),
        ([], 4, []),
    ],
)
def test_split_hand_worked(lengths, budget, expected):
    assert split_by_token_budget(lengths, budget) == expected


@SETTINGS
@given(lengths=st.lists(st.integers(0, 40), max_size=40), budget=st.integers(1, 32))
def test_split_properties(lengths, budget):
    batches = split_by_token_budget(lengths, budget)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    totals = [sum(lengths[i] for i in batch) for batch in batches]
    for batch, total in zip(batches, totals):
        assert batch == sorted(batch)
        # Over the budget only as one over-long sequence, alone.
        assert total <= budget or (len(batch) == 1 and lengths[batch[0]] > budget)
    # First fit: nothing in a later micro-batch would have fitted into an earlier one.
    for j, later in enumerate(batches):
        for earlier_total in totals[:j]:
            assert all(earlier_total + lengths[i] > budget for i in later)
    # Decreasing: each micro-batch's longest sequence is no longer than the previous one's.
    longest = [max(lengths[i] for i in batch) for batch in batches]
    assert longest == sorted(longest, reverse=True)
    assert over_budget(lengths, budget) == sum(
        len(batch) == 1 and lengths[batch[0]] > budget for batch in batches
    )


def test_over_budget_counts_strictly_longer():
    assert over_budget([3, 9, 4, 5], 4) == 2
    assert over_budget([], 1) == 0


@pytest.mark.parametrize("function", [split_by_token_budget, over_budget])
@pytest.mark.parametrize(
    "lengths, budget, error, name",
    [
        ([1, 2], 0, ValueError, "budget"),
        ([1, -2], 4, ValueError, r"lengths\[1\]"),
        ([1, 2], 2.5, TypeError, "budget"),
        ([1.0], 4, TypeError, r"lengths\[0\]"),
    ],
)
def test_split_rejects_bad_input_by_name(function, lengths, budget, error, name):
    with pytest.raises(error, match=name):
        function(lengths, budget)


# balance_over_ranks


@pytest.mark.parametrize(
    "costs, expected",
    [
        # The 5 stays (moving it makes rank 1 the busier); the 1 moves.
        ([[5, 1], [1]], [[(0, 0)], [(0, 1), (1, 0)]]),
        # Of the two candidates the 5 evens the pair (6, 6); the 6 would give (5, 7).
        ([[6, 5], [1]], [[(0, 0)], [(0, 1), (1, 0)]]),
        # Equal costs: the lowest index moves first, to the lowest of the emptiest ranks.
        ([[4, 4, 4], [], []], [[(0, 2)], [(0, 0)], [(0, 1)]]),
        # Third move: rank 0 holds its own 1 and rank 1's 1; it passes on rank 1's (2 moved
        # sequences, not 3). Ends at loads (4, 5, 4): 5 = the least load + the cheapest cost.
        ([[1], [1, 1, 4], [3, 3]], [[(0, 0), (2, 0)], [(1, 1), (1, 2)], [(1, 0), (2, 1)]]),
        # Within the limit (1.02 * mean, or the largest cost): nothing moves.
        ([[10.1], [9.9]], [[(0, 0)], [(1, 0)]]),
        ([[11], [9]], [[(0, 0)], [(1, 0)]]),
        ([[0, 0], [], [0]], [[(0, 0), (0, 1)], [], [(2, 0)]]),
        ([[], []], [[], []]),
        ([], []),
    ],
)
def test_balance_hand_worked(costs, expected):
    assert balance_over_ranks(costs) == expected


def check_plan(costs, plan) -> None:
    """Every sequence exactly once, each rank's list sorted, and the stated guarantee."""
    everything = [(r, i) for r, row in enumerate(costs) for i in range(len(row))]
    assert sorted(p for pairs in plan for p in pairs) == everything
    assert all(pairs == sorted(pairs) for pairs in plan)
    load = loads(costs, plan)
    mean = math.fsum(c for row in costs for c in row) / len(costs)
    largest = max((c for row in costs for c in row), default=0.0)
    limit = max((1 + BALANCE_TOLERANCE) * mean, largest)
    busiest = max(range(len(plan)), key=lambda r: (load[r], -r))
    cheapest = min((costs[s][i] for s, i in plan[busiest] if costs[s][i] > 0), default=0.0)
    slack = 1e-9 * max(mean, 1.0)  # float rounding of the running loads
    assert load[busiest] <= max(limit, min(load) + cheapest) + slack
    assert load[busiest] <= mean + max(BALANCE_TOLERANCE * mean, largest) + slack


integer_costs = st.lists(st.lists(st.integers(0, 50), max_size=12), min_size=1, max_size=6)


@SETTINGS
@given(costs=integer_costs)
def test_balance_bound_and_idempotent_on_integer_costs(costs):
    plan = balance_over_ranks(costs)
    check_plan(costs, plan)
    # Balancing the result again moves nothing (exact sums: integer costs).
    again = [[costs[s][i] for s, i in pairs] for pairs in plan]
    assert moved(balance_over_ranks(again)) == 0


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1), ranks=st.integers(2, 8), hidden=st.sampled_from([1024, 4096])
)
def test_balance_long_tailed(seed, ranks, hidden):
    rng = random.Random(seed)
    costs = [
        [sequence_cost(n, hidden) for n in long_tailed(rng, rng.randint(4, 64))]
        for _ in range(ranks)
    ]
    plan = balance_over_ranks(costs)
    check_plan(costs, plan)
    mean = math.fsum(map(math.fsum, costs)) / ranks
    largest = max(c for row in costs for c in row)
    assert max(loads(costs, plan)) - mean <= max(largest, 0.1 * mean)


@SETTINGS
@given(
    base=st.lists(st.integers(1, 100), min_size=1, max_size=20),
    extras=st.lists(st.floats(0, 1), min_size=1, max_size=8),
)
def test_balance_moves_nothing_within_the_limit(base, extras):
    # Every rank holds the same costs (rotated) plus one extra of at most the tolerance.
    top = BALANCE_TOLERANCE * sum(base)
    costs = [
        base[r % len(base) :] + base[: r % len(base)] + [e * top] for r, e in enumerate(extras)
    ]
    plan = balance_over_ranks(costs)
    assert plan == [[(r, i) for i in range(len(row))] for r, row in enumerate(costs)]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), order=st.permutations(range(5)))
def test_balance_relabels_with_the_ranks_on_generic_costs(seed, order):
    # Holds when no two costs or loads are equal: continuous costs, no empty rank.
    rng = random.Random(seed)
    costs = [[rng.lognormvariate(0, 1.5) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    plan = balance_over_ranks(costs)
    relabelled = balance_over_ranks([costs[r] for r in order])
    new_label = {old: new for new, old in enumerate(order)}
    for new, old in enumerate(order):
        assert relabelled[new] == sorted((new_label[s], i) for s, i in plan[old])


def test_balance_is_pure():
    rng = random.Random(7)
    costs = [[sequence_cost(n, 4096) for n in long_tailed(rng, 20)] for _ in range(4)]
    costs[0] += costs[1]  # a busy rank, so sequences move
    snapshot = [list(row) for row in costs]
    plan = balance_over_ranks(costs)
    assert moved(plan) > 0
    assert costs == snapshot
    assert balance_over_ranks(tuple(tuple(row) for row in snapshot)) == plan


@pytest.mark.parametrize(
    "costs, error, name",
    [
        ([[1.0, -1.0]], ValueError, r"costs\[0\]\[1\]"),
        ([[1.0], [math.nan]], ValueError, r"costs\[1\]\[0\]"),
        ([[math.inf]], ValueError, r"costs\[0\]\[0\]"),
        ([[1.0, "2"]], TypeError, r"costs\[0\]\[1\]"),
    ],
)
def test_balance_rejects_bad_costs_by_name(costs, error, name):
    with pytest.raises(error, match=name):
        balance_over_ranks(costs)
