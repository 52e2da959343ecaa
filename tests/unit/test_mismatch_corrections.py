"""The band masks of the off-policy corrections (`token-mask`, `icepop`, `sequence-mask`,
`geometric-mask`) against a float64 reference written token by token, and how their weight
composes with BAPO's bounds: it multiplies the clipped surrogate and enters the contribution
statistics, so a masked token has no loss, no gradient and no part in P or N."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_megatron.algo import SearchPlan, bapo_loss, loss_normalizer
from bapo_megatron.algo.importance_weights import importance_weights
from bapo_megatron.config import ClipSearchConfig

BAND_MASKS = ("token-mask", "icepop", "sequence-mask", "geometric-mask")
BANDS = [(0.5, 2.0), (0.0, 1.3), (0.9, 5.0)]


def random_batch(seed: int, n: int = 14, s: int = 18, spread: float = 0.5):
    """Float32 proximal and behaviour log-probs, a response mask (row 0: one token, row 1: none)
    and nan / inf off the response, which the weights must ignore."""
    g = torch.Generator().manual_seed(seed)
    recomputed = -torch.rand(n, s, generator=g, dtype=torch.float64) * 3
    drift = torch.randn(n, 1, generator=g, dtype=torch.float64) * spread * 0.3
    noise = torch.randn(n, s, generator=g, dtype=torch.float64) * spread
    behaviour = recomputed - drift - noise
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[0, 3] = True
    for i in range(2, n):
        start = int(torch.randint(1, s // 2, (1,), generator=g))
        mask[i, start : start + int(torch.randint(1, s - start + 1, (1,), generator=g))] = True
    garbage = torch.where(torch.rand(n, s, generator=g) < 0.5, math.nan, math.inf)
    recomputed = torch.where(mask, recomputed.float(), garbage)
    behaviour = torch.where(mask, behaviour.float(), -garbage)
    return recomputed, behaviour, mask


def reference(correction, recomputed, behaviour, mask, low, high):
    """Weights and statistics one token at a time, Python floats (float64)."""
    n, s = mask.shape
    weights = torch.zeros(n, s, dtype=torch.float64)
    stats = dict.fromkeys(
        ("tokens", "clipped_tokens", "masked_tokens", "sequences", "masked_sequences"), 0
    )
    stats["weight_sum"] = 0.0
    for i in range(n):
        positions = [t for t in range(s) if mask[i, t]]
        if not positions:
            continue
        gaps = [float(recomputed[i, t]) - float(behaviour[i, t]) for t in positions]
        if correction in ("token-mask", "icepop"):
            inside = [low <= math.exp(d) <= high for d in gaps]
            values = [
                (math.exp(d) if correction == "icepop" else 1.0) if keep else 0.0
                for d, keep in zip(gaps, inside)
            ]
        else:
            log_ratio = math.fsum(gaps)
            if correction == "geometric-mask":
                log_ratio /= len(positions)
            keep = low <= math.exp(log_ratio) <= high
            inside = [keep] * len(positions)
            values = [1.0 if keep else 0.0] * len(positions)
        for t, value in zip(positions, values):
            weights[i, t] = value
        masked = [not keep for keep in inside]
        stats["weight_sum"] += math.fsum(values)
        stats["tokens"] += len(positions)
        stats["clipped_tokens"] += sum(masked)
        stats["masked_tokens"] += sum(masked)
        stats["sequences"] += 1
        stats["masked_sequences"] += all(masked)
    return weights, stats


@pytest.mark.parametrize("correction", BAND_MASKS)
@pytest.mark.parametrize("band", BANDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_band_masks_match_the_float64_reference(correction, band, seed):
    recomputed, behaviour, mask = random_batch(seed)
    got = importance_weights(correction, recomputed, behaviour, mask, None, band)
    weights, stats = reference(correction, recomputed, behaviour, mask, *band)
    assert got.weights.dtype == torch.float32 and got.weights.isfinite().all()
    torch.testing.assert_close(got.weights.double(), weights, rtol=1e-6, atol=0.0)
    statistics = got.statistics
    assert float(statistics.weight_sum) == pytest.approx(stats["weight_sum"], rel=1e-6)
    for name in ("tokens", "clipped_tokens", "masked_tokens", "sequences", "masked_sequences"):
        assert int(getattr(statistics, name)) == stats[name], name
    assert stats["sequences"] == mask.shape[0] - 1


@pytest.mark.parametrize("correction", ["token-mask", "icepop"])
def test_token_masks_touch_some_tokens_and_keep_others(correction):
    # the batches exercise both sides of the band at the token level
    for seed in range(3):
        recomputed, behaviour, mask = random_batch(seed)
        got = importance_weights(correction, recomputed, behaviour, mask, None, (0.5, 2.0))
        assert 0 < int(got.statistics.masked_tokens) < int(got.statistics.tokens)


def test_geometric_mask_is_the_sequence_mask_of_the_mean_log_ratio():
    # a sequence of n tokens with log ratio 0.1 each: exp(D) = e^(0.1 n) leaves [0.5, 2] for
    # n >= 7, the geometric mean e^0.1 never does
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, :2], mask[1, :7], mask[2, :12] = True, True, True
    behaviour = torch.full((3, 12), -1.0)
    recomputed = behaviour + 0.1
    sequence = importance_weights("sequence-mask", recomputed, behaviour, mask, None, (0.5, 2.0))
    geometric = importance_weights("geometric-mask", recomputed, behaviour, mask, None, (0.5, 2.0))
    assert sequence.weights.amax(-1).tolist() == [1.0, 0.0, 0.0]
    assert geometric.weights.amax(-1).tolist() == [1.0, 1.0, 1.0]
    assert int(sequence.statistics.masked_sequences) == 2
    assert int(sequence.statistics.masked_tokens) == 7 + 12


def test_sequence_mask_without_a_band_keeps_its_cap_band():
    recomputed, behaviour, mask = random_batch(4, spread=0.8)
    by_cap = importance_weights("sequence-mask", recomputed, behaviour, mask, 2.0)
    by_band = importance_weights("sequence-mask", recomputed, behaviour, mask, None, (0.5, 2.0))
    assert torch.equal(by_cap.weights, by_band.weights)
    # the truncations ignore the band and keep their cap
    token = importance_weights("token-truncate", recomputed, behaviour, mask, 2.0, (0.1, 9.0))
    assert float(token.weights.max()) <= 2.0 and int(token.statistics.masked_tokens) == 0


def test_a_reversed_band_is_refused():
    recomputed, behaviour, mask = random_batch(0)
    with pytest.raises(ValueError, match="band must have 0 <= a <= b"):
        importance_weights("icepop", recomputed, behaviour, mask, None, (2.0, 0.5))
    with pytest.raises(ValueError, match="cap must be > 0"):
        importance_weights("token-mask", recomputed, behaviour, mask, None, None)


def _loss_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, s = 10, 16
    recomputed, behaviour, mask = random_batch(seed, n=n, s=s)
    logp_old = torch.where(mask, recomputed, 0.0).double()
    drift = torch.randn(n, s, generator=g, dtype=torch.float64) * 0.3
    logp_new = (logp_old + drift).requires_grad_(True)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    return logp_new, logp_old, advantages, mask, recomputed, behaviour


@pytest.mark.parametrize("correction", BAND_MASKS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_weight_multiplies_the_clipped_surrogate_and_enters_p_and_n(correction, seed):
    logp_new, logp_old, advantages, mask, recomputed, behaviour = _loss_inputs(seed)
    weights = importance_weights(
        correction, recomputed, behaviour, mask, None, (0.6, 1.8)
    ).weights.double()
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper", dual_clip=3.0))
    normalizer = loss_normalizer(mask, "token-mean")
    loss, metrics = bapo_loss(
        logp_new,
        logp_old,
        advantages,
        mask,
        plan=plan,
        normalizer=normalizer,
        is_weights=weights,
        backend="torch",
    )
    loss.backward()
    c_low, c_high = float(metrics["bapo/c_low"]), float(metrics["bapo/c_high"])

    # float64 reference, token by token, at the bounds the search chose
    new = logp_new.detach()
    want_loss, p, n_sum = 0.0, 0.0, 0.0
    want_grad = torch.zeros_like(new)
    for i, t in mask.nonzero().tolist():
        r = math.exp(float(new[i, t]) - float(logp_old[i, t]))
        a = float(advantages[i]) * float(weights[i, t])
        if a > 0:
            value, passes = -a * min(r, c_high), r <= c_high
            p += a * r if passes else 0.0
        else:
            value, passes = -a * min(max(r, c_low), 3.0), c_low <= r <= 3.0
            n_sum += -a * r if passes and a < 0 else 0.0
        want_loss += value
        want_grad[i, t] = -a * r if passes else 0.0
    tokens = int(mask.sum())
    assert float(loss.detach()) == pytest.approx(want_loss / tokens, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logp_new.grad, want_grad / tokens, rtol=1e-10, atol=1e-12)
    assert float(metrics["bapo/positive_contribution"]) == pytest.approx(p, rel=1e-10, abs=1e-12)
    assert float(metrics["bapo/negative_contribution"]) == pytest.approx(
        n_sum, rel=1e-10, abs=1e-12
    )


def test_a_masked_token_has_no_part_in_loss_gradient_or_search():
    # moving the current log-prob of masked tokens anywhere changes nothing
    logp_new, logp_old, advantages, mask, recomputed, behaviour = _loss_inputs(3)
    weights = importance_weights("icepop", recomputed, behaviour, mask, None, (0.6, 1.8)).weights
    masked = mask & (weights == 0)
    assert masked.any()
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))

    def run(new):
        new = new.detach().requires_grad_(True)
        loss, metrics = bapo_loss(
            new,
            logp_old,
            advantages,
            mask,
            plan=plan,
            normalizer=loss_normalizer(mask, "token-mean"),
            is_weights=weights.double(),
            backend="torch",
        )
        loss.backward()
        return loss.detach(), new.grad, metrics

    moved = torch.where(masked, logp_new.detach() + 3.0, logp_new.detach())
    base, shifted = run(logp_new), run(moved)
    assert float(base[0]) == pytest.approx(float(shifted[0]), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(base[1], shifted[1], rtol=1e-12, atol=1e-15)
    assert base[1][masked].eq(0).all()
    for key in ("bapo/c_low", "bapo/c_high", "bapo/positive_contribution"):
        assert float(base[2][key]) == pytest.approx(float(shifted[2][key]), rel=1e-12), key
