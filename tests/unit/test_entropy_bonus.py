"""The entropy bonus of ``bapo_loss`` (``loss.entropy_coef``) against a float64 reference written
in the test, for every aggregation: the loss is the policy loss minus c times the aggregated
entropy, its gradients reach both inputs, and the clip search never sees it."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_megatron.algo import SearchPlan, bapo_loss, loss_normalizer
from bapo_megatron.config import AGGREGATIONS, ClipSearchConfig

PLAN = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, s = 9, 14
    mask = torch.zeros(n, s, dtype=torch.bool)
    for i in range(n):
        start = int(torch.randint(0, 5, (1,), generator=g))
        mask[i, start : start + int(torch.randint(0, s - start + 1, (1,), generator=g))] = True
    logp_old = -torch.rand(n, s, generator=g, dtype=torch.float64) * 3
    logp_new = (
        logp_old + 0.3 * torch.randn(n, s, generator=g, dtype=torch.float64)
    ).requires_grad_()
    entropy = (torch.rand(n, s, generator=g, dtype=torch.float64) * 2).requires_grad_()
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    return logp_new, logp_old, entropy, advantages, mask


def run(logp_new, logp_old, entropy, advantages, mask, aggregation, coef):
    loss, metrics = bapo_loss(
        logp_new,
        logp_old,
        advantages,
        mask,
        plan=PLAN,
        normalizer=loss_normalizer(mask, aggregation),
        aggregation=aggregation,
        entropy=entropy,
        entropy_coef=coef,
        backend="torch",
    )
    return loss, metrics


def reference_bonus(entropy, mask, aggregation, coef):
    """c times the entropy aggregated by hand; and its gradient with respect to the entropy."""
    rows = [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    grad = torch.zeros_like(entropy, dtype=torch.float64)
    if aggregation == "token-mean":
        count = sum(len(r) for r in rows)
        total = math.fsum(float(entropy[i, t]) for i, r in enumerate(rows) for t in r) / count
        for i, r in enumerate(rows):
            for t in r:
                grad[i, t] = 1 / count
    else:
        sequences = [i for i, r in enumerate(rows) if r]
        parts = []
        for i in sequences:
            values = [float(entropy[i, t]) for t in rows[i]]
            per = 1 / len(values) if aggregation == "seq-mean-token-mean" else 1.0
            parts.append(math.fsum(values) * per)
            for t in rows[i]:
                grad[i, t] = per / len(sequences)
        total = math.fsum(parts) / len(sequences)
    return coef * total, coef * grad


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_bonus_is_subtracted_as_aggregated_and_stays_out_of_the_search(aggregation, seed):
    coef = 0.03
    logp_new, logp_old, entropy, advantages, mask = inputs(seed)
    with_bonus, metrics = run(logp_new, logp_old, entropy, advantages, mask, aggregation, coef)
    with_bonus.backward()
    grads = logp_new.grad.clone(), entropy.grad.clone()
    logp_new.grad = None
    without, plain = run(logp_new, logp_old, None, advantages, mask, aggregation, 0.0)
    without.backward()

    bonus, entropy_grad = reference_bonus(entropy.detach(), mask, aggregation, coef)
    assert float(with_bonus.detach()) == pytest.approx(
        float(without.detach()) - bonus, rel=1e-12, abs=1e-14
    )
    assert float(metrics["actor/entropy_bonus"]) == pytest.approx(bonus, rel=1e-12)
    torch.testing.assert_close(grads[1], -entropy_grad, rtol=1e-12, atol=1e-15)
    # the policy-gradient part and the search are the bonus-free ones
    torch.testing.assert_close(grads[0], logp_new.grad, rtol=0, atol=0)
    assert "actor/entropy_bonus" not in plain
    for key, value in plain.items():
        assert torch.equal(metrics[key], value), key


def test_no_coefficient_is_the_loss_as_before_bit_for_bit():
    logp_new, logp_old, entropy, advantages, mask = inputs(5)
    before, _ = bapo_loss(
        logp_new,
        logp_old,
        advantages,
        mask,
        plan=PLAN,
        normalizer=loss_normalizer(mask, "token-mean"),
        backend="torch",
    )
    after, metrics = run(logp_new, logp_old, entropy, advantages, mask, "token-mean", 0.0)
    assert torch.equal(before, after) and "actor/entropy_bonus" not in metrics


def test_a_coefficient_without_entropies_is_refused():
    logp_new, logp_old, entropy, advantages, mask = inputs(0)
    with pytest.raises(ValueError, match="entropy: bapo_loss needs the token entropies"):
        run(logp_new, logp_old, None, advantages, mask, "token-mean", 0.1)
    with pytest.raises(ValueError, match="entropy: shape"):
        run(logp_new, logp_old, entropy[:, 1:], advantages, mask, "token-mean", 0.1)
