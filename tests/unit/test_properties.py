"""Property tests of the search and the loss on hypothesis-drawn batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_megatron.algo import (
    SearchPlan,
    bapo_loss,
    choose_bounds,
    contribution_stats,
    importance_ratio,
    loss_normalizer,
    search_statistics,
)
from bapo_megatron.config import ClipSearchConfig
from tests.helpers.random_batches import SEARCH_VARIANTS, random_batch

variants = st.sampled_from(SEARCH_VARIANTS)
seeds = st.integers(0, 2**31 - 1)
SETTINGS = settings(max_examples=60, deadline=None)


def _decide(batch, plan):
    ratio, log_ratio = importance_ratio(batch["logp_new"].detach(), batch["logp_old"])
    adv = batch["advantages"]
    adv = adv[:, None].expand_as(ratio) if adv.dim() == 1 else adv
    stats, _ = contribution_stats(ratio, log_ratio, adv, batch["mask"], plan)
    return choose_bounds(stats, plan)


@SETTINGS
@given(seed=seeds, variant=variants)
def test_gradient_semantics_never_lowers_rho(seed, variant):
    preset, overrides = variant
    cfg = ClipSearchConfig.from_preset(preset, **{**overrides, "semantics": "gradient"})
    decision = _decide(random_batch(seed), SearchPlan.from_config(cfg))
    before, after = (
        decision.metrics["bapo/rho_before"].item(),
        decision.metrics["bapo/rho_after"].item(),
    )
    assert after >= before - 1e-12


@SETTINGS
@given(seed=seeds, variant=variants)
def test_bounds_in_range_and_target_met_or_range_exhausted(seed, variant):
    preset, overrides = variant
    cfg = ClipSearchConfig.from_preset(preset, **overrides)
    plan = SearchPlan.from_config(cfg)
    decision = _decide(random_batch(seed), plan)
    assert cfg.c_low_start <= decision.c_low.item() <= cfg.c_low_max
    assert cfg.c_high_start <= decision.c_high.item() <= cfg.c_high_max
    met = decision.metrics["bapo/target_met"].item() == 1.0
    assert met or int(decision.steps) == plan.max_steps
    if met and int(decision.steps) > 0:
        # The walk stops at the first position that meets the target.
        assert 0 <= int(decision.steps) <= plan.max_steps


@settings(max_examples=40, deadline=None)
@given(seed=seeds, variant=variants, splits=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_token_mean_is_independent_of_the_split(seed, variant, splits):
    """One optimizer step split into micro-batches on ranks: same decision, loss and gradient."""
    preset, overrides = variant
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset(preset, **overrides))
    batch = random_batch(seed, batch=sum(splits) + 2)
    whole_norm = loss_normalizer(batch["mask"], "token-mean")
    whole_loss, whole_metrics = bapo_loss(
        batch["logp_new"],
        batch["logp_old"],
        batch["advantages"],
        batch["mask"],
        plan=plan,
        normalizer=whole_norm,
    )
    (whole_grad,) = torch.autograd.grad(whole_loss, batch["logp_new"])

    # Pieces: each "rank/micro-batch" holds a row slice (the last one holds the remainder).
    bounds = [0]
    for size in splits:
        bounds.append(min(bounds[-1] + size, batch["mask"].shape[0]))
    bounds.append(batch["mask"].shape[0])
    pieces = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    leaf = batch["logp_new"].detach().requires_grad_(True)
    # Decide once over all pieces (stats summed = what one all-reduce gives), then sum the losses.
    total_stats = sum(
        search_statistics(
            leaf[sl], batch["logp_old"][sl], batch["advantages"][sl], batch["mask"][sl], plan=plan
        )[0]
        for sl in pieces
    )
    decision = choose_bounds(total_stats, plan)
    total = sum(
        bapo_loss(
            leaf[sl],
            batch["logp_old"][sl],
            batch["advantages"][sl],
            batch["mask"][sl],
            plan=plan,
            normalizer=whole_norm,
            decision=decision,
        )[0]
        for sl in pieces
    )
    (split_grad,) = torch.autograd.grad(total, leaf)
    assert decision.c_low.item() == whole_metrics["bapo/c_low"].item()
    assert decision.c_high.item() == whole_metrics["bapo/c_high"].item()
    torch.testing.assert_close(total, whole_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-15)
