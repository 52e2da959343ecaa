"""The off-policy corrections' importance weights (bapo_megatron/algo/importance_weights.py)
at the cap alone against a float64 reference written token by token (the band masks:
tests/unit/test_mismatch_corrections.py), on random right-padded batches whose padding
holds garbage, with sequences of one response token and sequences without any."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_megatron.algo.importance_weights import WEIGHTED_CORRECTIONS, importance_weights


def random_batch(seed: int, n: int = 12, s: int = 20, spread: float = 0.6):
    """Float32 proximal and behaviour log-probs and a response mask: row 0 has one response
    token, row 1 none, the others a random prompt and response length; off the response the
    log-probs are nan or inf (the function must ignore them)."""
    g = torch.Generator().manual_seed(seed)
    recomputed = -torch.rand(n, s, generator=g, dtype=torch.float64) * 3
    # per-sequence drift plus per-token noise: some sequences far off-policy, some close
    drift = torch.randn(n, 1, generator=g, dtype=torch.float64) * spread
    behaviour = recomputed - drift - torch.randn(n, s, generator=g, dtype=torch.float64) * spread
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[0, 5] = True
    for i in range(2, n):
        start = int(torch.randint(1, s // 2, (1,), generator=g))
        length = int(torch.randint(1, s - start + 1, (1,), generator=g))
        mask[i, start : start + length] = True
    recomputed, behaviour = recomputed.float(), behaviour.float()
    garbage = torch.where(torch.rand(n, s, generator=g) < 0.5, math.nan, math.inf)
    recomputed = torch.where(mask, recomputed, garbage)
    behaviour = torch.where(mask, behaviour, -garbage)
    return recomputed, behaviour, mask


def reference(correction, recomputed, behaviour, mask, cap):
    """Weights and statistics, one token at a time in float64 (Python floats)."""
    n, s = mask.shape
    weights = torch.zeros(n, s, dtype=torch.float64)
    stats = dict.fromkeys(
        (
            "weight_sum",
            "tokens",
            "clipped_tokens",
            "sequences",
            "clipped_sequences",
            "masked_sequences",
        ),
        0.0,
    )
    for i in range(n):
        positions = [t for t in range(s) if mask[i, t]]
        if not positions:
            continue
        gaps = [float(recomputed[i, t]) - float(behaviour[i, t]) for t in positions]
        if correction == "token-truncate":
            raw = [math.exp(d) for d in gaps]
            values = [min(r, cap) for r in raw]
            clipped = [r > cap for r in raw]
        else:
            sequence = math.exp(math.fsum(gaps))
            if correction == "sequence-truncate":
                value, cut = min(sequence, cap), sequence > cap
            else:
                cut = not 1 / cap <= sequence <= cap
                value = 0.0 if cut else 1.0
                stats["masked_sequences"] += cut
            values, clipped = [value] * len(positions), [cut] * len(positions)
        for t, value in zip(positions, values):
            weights[i, t] = value
        stats["weight_sum"] += math.fsum(values)
        stats["tokens"] += len(positions)
        stats["clipped_tokens"] += sum(clipped)
        stats["sequences"] += 1
        stats["clipped_sequences"] += any(clipped)
    return weights, stats


@pytest.mark.parametrize("correction", ["token-truncate", "sequence-truncate", "sequence-mask"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("cap", [1.5, 3.0])
def test_weights_and_statistics_match_the_float64_reference(correction, seed, cap):
    recomputed, behaviour, mask = random_batch(seed)
    got = importance_weights(correction, recomputed, behaviour, mask, cap)
    weights, stats = reference(correction, recomputed, behaviour, mask, cap)
    assert got.weights.dtype == torch.float32
    assert got.weights.isfinite().all()
    torch.testing.assert_close(got.weights.double(), weights, rtol=1e-6, atol=0.0)
    statistics = got.statistics
    assert float(statistics.weight_sum) == pytest.approx(stats["weight_sum"], rel=1e-6)
    for name in ("tokens", "clipped_tokens", "sequences", "clipped_sequences", "masked_sequences"):
        assert float(getattr(statistics, name)) == stats[name], name
    # the batches exercise the cap: some units cut, some kept
    assert 0 < stats["clipped_tokens"] < stats["tokens"]
    assert stats["sequences"] == mask.shape[0] - 1  # row 1 has no response token


def test_token_truncate_is_the_trainers_expression_bit_for_bit():
    # runs that set loss.truncated_is_cap before the corrections existed keep their numbers
    recomputed, behaviour, mask = random_batch(7)
    got = importance_weights("token-truncate", recomputed, behaviour, mask, 2.0)
    uncapped = torch.exp(recomputed - behaviour)
    assert torch.equal(got.weights, torch.where(mask, uncapped.clamp(max=2.0), 0.0))
    assert torch.equal(got.statistics.weight_sum, got.weights.sum())
    assert int(got.statistics.clipped_tokens) == int((uncapped[mask] > 2.0).sum())


def test_a_sequence_of_one_token_weighs_the_same_at_both_levels():
    recomputed, behaviour, mask = random_batch(5, spread=1.0)
    row = mask[0]
    token = importance_weights("token-truncate", recomputed, behaviour, mask, 1.5).weights
    sequence = importance_weights("sequence-truncate", recomputed, behaviour, mask, 1.5).weights
    torch.testing.assert_close(sequence[0, row], token[0, row], rtol=1e-6, atol=0.0)


def test_sequence_mask_rejects_both_tails_and_keeps_the_rest_at_one():
    # one response token per row, log weights -2, -0.5, 0, 0.5, 2 against a cap of e
    log_weights = torch.tensor([-2.0, -0.5, 0.0, 0.5, 2.0])
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[:, 1] = True
    behaviour = torch.full((5, 3), -1.0)
    recomputed = behaviour + log_weights[:, None]
    got = importance_weights("sequence-mask", recomputed, behaviour, mask, math.e)
    assert got.weights[:, 1].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert (got.weights[:, [0, 2]] == 0).all()
    assert int(got.statistics.masked_sequences) == int(got.statistics.clipped_sequences) == 2
    assert float(got.statistics.weight_sum) == 3.0


def test_far_off_policy_sequences_are_truncated_without_overflow():
    # sums of hundreds of large gaps: exp would overflow float64, the weight must still be C or 0
    mask = torch.zeros(2, 401, dtype=torch.bool)
    mask[:, 1:] = True
    recomputed = torch.zeros(2, 401)
    behaviour = torch.stack([torch.full((401,), -5.0), torch.full((401,), 5.0)])
    got = importance_weights("sequence-truncate", recomputed, behaviour, mask, 2.0)
    assert got.weights[0, 1:].eq(2.0).all() and got.weights[1, 1:].eq(0.0).all()
    assert int(got.statistics.clipped_sequences) == 1
    masked = importance_weights("sequence-mask", recomputed, behaviour, mask, 2.0)
    assert int(masked.statistics.masked_sequences) == 2 and masked.weights.eq(0).all()


@pytest.mark.parametrize(
    "correction, cap, shape, message",
    [
        ("none", 2.0, (2, 3), "must be one of"),
        ("sequence-clip", 2.0, (2, 3), "must be one of"),
        ("token-truncate", 0.0, (2, 3), "cap must be > 0"),
        ("sequence-mask", 2.0, (2, 4), "same"),
    ],
)
def test_bad_arguments_are_refused(correction, cap, shape, message):
    mask = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        importance_weights(correction, torch.zeros(shape), torch.zeros(2, 3), mask, cap)


@pytest.mark.parametrize("correction", WEIGHTED_CORRECTIONS)
def test_a_rank_without_sequences_adds_zeros(correction):
    # a mini-batch can be empty on one data-parallel rank and not on the others
    empty = torch.zeros(0, 5)
    got = importance_weights(correction, empty, empty, torch.zeros(0, 5, dtype=torch.bool), 2.0)
    assert got.weights.shape == (0, 5)
    assert all(float(v) == 0.0 for v in vars(got.statistics).values())
