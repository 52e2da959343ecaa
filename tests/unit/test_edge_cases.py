"""Edge cases: a defined result or a clear error."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.algo import SearchPlan, bapo_loss, loss_normalizer, truncated_importance_weights
from bapo_megatron.config import ClipSearchConfig

PAPER = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
REFERENCE = SearchPlan.from_config(ClipSearchConfig.from_preset("reference"))


def _batch(advantages, mask=None, spread=0.8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (4, 8)
    logp_old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    logp_new = (
        logp_old + spread * torch.randn(shape, generator=g, dtype=torch.float64)
    ).requires_grad_(True)
    mask = torch.ones(shape, dtype=torch.bool) if mask is None else mask
    return logp_new, logp_old, torch.as_tensor(advantages, dtype=torch.float64), mask


def _run(plan, logp_new, logp_old, adv, mask, **kw):
    return bapo_loss(
        logp_new,
        logp_old,
        adv,
        mask,
        plan=plan,
        normalizer=loss_normalizer(mask, "token-mean"),
        **kw,
    )


@pytest.mark.parametrize("plan", [PAPER, REFERENCE])
def test_all_advantages_zero_no_search(plan):
    loss, m = _run(plan, *_batch([0.0, 0.0, 0.0, 0.0]))
    assert int(m["bapo/search_steps"]) == 0
    assert (m["bapo/c_low"].item(), m["bapo/c_high"].item()) == (
        plan.c_low_values[0],
        plan.c_high_values[0],
    )
    assert m["bapo/rho_before"].item() == 0.0 and loss.item() == 0.0


@pytest.mark.parametrize("plan", [PAPER, REFERENCE])
def test_all_positive_target_met_at_once(plan):
    _, m = _run(plan, *_batch([1.0, 2.0, 0.5, 1.5]))
    assert int(m["bapo/search_steps"]) == 0 and m["bapo/target_met"].item() == 1.0
    assert m["bapo/rho_before"].item() == 1.0


@pytest.mark.parametrize("plan", [PAPER, REFERENCE])
def test_all_negative_exhausts_the_range(plan):
    _, m = _run(plan, *_batch([-1.0, -2.0, -0.5, -1.5]))
    assert int(m["bapo/search_steps"]) == plan.max_steps
    assert (m["bapo/c_low"].item(), m["bapo/c_high"].item()) == (
        plan.c_low_values[-1],
        plan.c_high_values[-1],
    )
    assert m["bapo/rho_after"].item() == 0.0


def test_empty_mask_gives_zero_loss_with_a_graph():
    mask = torch.zeros(4, 8, dtype=torch.bool)
    logp_new, logp_old, adv, mask = _batch([1.0, -1.0, 2.0, -2.0], mask=mask)
    loss, m = _run(PAPER, logp_new, logp_old, adv, mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logp_new.grad) == 0
    assert int(m["bapo/search_steps"]) == 0 and m["bapo/tokens"].item() == 0.0
    assert m["bapo/ratio_min_local"].item() == float("inf")


def test_rank_without_response_tokens_uses_the_global_decision_and_normalizer():
    # A rank whose micro-batch is all padding still takes part: its reduce sees the others' stats.
    logp_new, logp_old, adv, _ = _batch([1.0, -1.0, 2.0, -2.0])
    empty = torch.zeros(4, 8, dtype=torch.bool)
    others = _batch([-1.0, -1.0, -2.0, 0.5], seed=1)
    from bapo_megatron.algo import contribution_stats, importance_ratio

    ratio, log_ratio = importance_ratio(others[0].detach(), others[1])
    other_stats, _ = contribution_stats(
        ratio, log_ratio, others[2][:, None].expand(4, 8), others[3], PAPER
    )
    loss, m = bapo_loss(
        logp_new,
        logp_old,
        adv,
        empty,
        plan=PAPER,
        normalizer=32.0,
        reduce=lambda s: s + other_stats,
    )
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logp_new.grad) == 0
    assert m["bapo/tokens"].item() == 32.0 and int(m["bapo/search_steps"]) > 0


@pytest.mark.parametrize("name", ["logp_new", "logp_old", "advantages"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_are_named(name, bad):
    logp_new, logp_old, adv, mask = _batch([1.0, -1.0, 2.0, -2.0])
    inputs = {
        "logp_new": logp_new.detach().clone(),
        "logp_old": logp_old.clone(),
        "advantages": adv.clone(),
    }
    inputs[name][1] = bad
    with pytest.raises(ValueError, match=f"^{name}: .*non-finite"):
        _run(PAPER, inputs["logp_new"], inputs["logp_old"], inputs["advantages"], mask)


def test_non_finite_values_under_padding_are_ignored():
    logp_new, logp_old, adv, mask = _batch([1.0, -1.0, 2.0, -2.0])
    mask[:, -2:] = False
    logp_old = logp_old.clone()
    logp_old[:, -1] = float("nan")
    loss, _ = _run(PAPER, logp_new, logp_old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp_new.grad).all()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda b: (b[0], b[1][:, :-1], b[2], b[3]), "logp_old: shape"),
        (lambda b: (b[0], b[1], b[2], b[3][:-1]), "mask: shape"),
        (lambda b: (b[0], b[1], b[2][:-1], b[3]), "advantages: shape"),
        (
            lambda b: (b[0][0], b[1][0], b[2], b[3][0]),
            r"logp_new: expected shape \[batch, tokens\]",
        ),
        (lambda b: (b[0], b[1], b[2], b[3].to(torch.int64) * 2), "mask: expected bool or 0/1"),
    ],
)
def test_mismatched_shapes_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        _run(PAPER, *change(_batch([1.0, -1.0, 2.0, -2.0])))


def test_bad_aggregation_is_named():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        _run(PAPER, *_batch([1.0, -1.0, 2.0, -2.0]), aggregation="sum")


def test_truncated_importance_weights_are_capped_and_detached():
    recomputed = torch.tensor([0.0, -1.0, -5.0], requires_grad=True)
    behaviour = torch.tensor([-3.0, -1.0, -1.0])
    w = truncated_importance_weights(recomputed, behaviour, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0, torch.exp(torch.tensor(-4.0)).item()]))
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(recomputed, behaviour, cap=0.0)


def test_statistics_refuse_mismatched_shapes():
    from bapo_megatron.algo import contribution_stats, importance_ratio

    logp_new, logp_old, adv, mask = _batch([1.0, -1.0, 2.0, -2.0])
    ratio, log_ratio = importance_ratio(logp_new.detach(), logp_old)
    for backend in ("numba", "torch"):
        with pytest.raises(ValueError, match=r"advantages: shape \(4,\) does not match ratio"):
            contribution_stats(ratio, log_ratio, adv, mask, PAPER, backend)


def test_search_statistics_match_what_the_loss_decides():
    from bapo_megatron.algo import choose_bounds, search_statistics

    logp_new, logp_old, adv, mask = _batch([1.0, -1.0, 2.0, -2.0], spread=1.5)
    weights = torch.rand(4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    stats, _ = search_statistics(logp_new, logp_old, adv, mask, plan=PAPER, is_weights=weights)
    decision = choose_bounds(stats, PAPER)
    _, m = _run(PAPER, logp_new, logp_old, adv, mask, is_weights=weights)
    assert int(m["bapo/search_steps"]) == int(decision.steps) > 0
    assert m["bapo/c_high"].item() == decision.c_high.item()
