"""The vectorised search and the loss against the plain float64 step-by-step reference."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.algo import (
    SearchPlan,
    bapo_loss,
    choose_bounds,
    contribution_stats,
    importance_ratio,
    loss_normalizer,
)
from bapo_megatron.config import AGGREGATIONS, ClipSearchConfig
from tests.helpers import bapo_reference as ref
from tests.helpers.random_batches import SEARCH_VARIANTS, random_batch

SEEDS = range(40)


def _reference_for(batch, cfg):
    adv = batch["advantages"]
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(batch["logp_old"])
    r = ref.ratio_of(batch["logp_new"].detach(), batch["logp_old"])
    return ref.search(r, adv, batch["mask"], cfg)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("preset,overrides", SEARCH_VARIANTS)
def test_bounds_and_steps_match_reference(preset, overrides, backend):
    cfg = ClipSearchConfig.from_preset(preset, **overrides)
    plan = SearchPlan.from_config(cfg)
    moved = 0
    for seed in SEEDS:
        batch = random_batch(seed)
        expected = _reference_for(batch, cfg)
        ratio, log_ratio = importance_ratio(batch["logp_new"].detach(), batch["logp_old"])
        adv = batch["advantages"]
        if adv.dim() == 1:
            adv = adv[:, None].expand_as(ratio)
        stats, _ = contribution_stats(ratio, log_ratio, adv, batch["mask"], plan, backend=backend)
        decision = choose_bounds(stats, plan)
        got = (decision.c_low.item(), decision.c_high.item(), int(decision.steps))
        assert got == (expected.c_low, expected.c_high, expected.steps), f"seed {seed}"
        m = decision.metrics
        assert m["bapo/rho_before"].item() == pytest.approx(
            expected.rho_before, rel=1e-12, abs=1e-15
        )
        assert m["bapo/rho_after"].item() == pytest.approx(expected.rho_after, rel=1e-12, abs=1e-15)
        assert m["bapo/positive_contribution"].item() == pytest.approx(
            expected.positive, rel=1e-12, abs=1e-13
        )
        assert m["bapo/negative_contribution"].item() == pytest.approx(
            expected.negative, rel=1e-12, abs=1e-13
        )
        moved += expected.steps > 0
    if not plan.is_fixed:
        assert moved >= 5, "the random batches should make the search move"


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("preset,overrides", SEARCH_VARIANTS[:8])
def test_loss_and_gradient_match_reference(preset, overrides, aggregation):
    cfg = ClipSearchConfig.from_preset(preset, **overrides)
    plan = SearchPlan.from_config(cfg)
    for seed in range(100, 115):
        batch = random_batch(seed)
        use_weights = seed % 2 == 0
        g = torch.Generator().manual_seed(seed)
        weights = (
            torch.rand(batch["mask"].shape, generator=g, dtype=torch.float64) * 2
            if use_weights
            else None
        )
        normalizer = loss_normalizer(batch["mask"], aggregation)
        loss, metrics = bapo_loss(
            batch["logp_new"],
            batch["logp_old"],
            batch["advantages"],
            batch["mask"],
            plan=plan,
            normalizer=normalizer,
            aggregation=aggregation,
            is_weights=weights,
        )
        loss.backward()
        adv = batch["advantages"]
        adv_tokens = adv[:, None].expand_as(batch["logp_old"]) if adv.dim() == 1 else adv
        # The reference searches with the weighted advantage, as the package does.
        eff = adv_tokens * weights if use_weights else adv_tokens
        r = ref.ratio_of(batch["logp_new"].detach(), batch["logp_old"])
        expected = ref.search(r, eff, batch["mask"], cfg)
        assert metrics["bapo/c_low"].item() == expected.c_low
        assert metrics["bapo/c_high"].item() == expected.c_high
        ref_loss, ref_grad = ref.loss_and_grad(
            batch["logp_new"].detach(),
            batch["logp_old"],
            adv,
            batch["mask"],
            expected.c_low,
            expected.c_high,
            cfg.dual_clip,
            aggregation,
            normalizer,
            is_weights=weights,
        )
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(batch["logp_new"].grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_float32_inputs_agree_with_float64_reference():
    cfg = ClipSearchConfig.from_preset("paper")
    plan = SearchPlan.from_config(cfg)
    agree = 0
    for seed in range(200, 220):
        batch = random_batch(seed, batch=16, tokens=48)
        b32 = {k: (v.detach().float() if v.is_floating_point() else v) for k, v in batch.items()}
        loss, metrics = bapo_loss(
            b32["logp_new"],
            b32["logp_old"],
            b32["advantages"],
            b32["mask"],
            plan=plan,
            normalizer=loss_normalizer(b32["mask"], "token-mean"),
        )
        assert loss.dtype == torch.float32
        expected = _reference_for(batch, cfg)
        agree += (metrics["bapo/c_low"].item(), metrics["bapo/c_high"].item()) == (
            expected.c_low,
            expected.c_high,
        )
    assert agree >= 19  # float32 rounding may flip a decision that sits on the target
