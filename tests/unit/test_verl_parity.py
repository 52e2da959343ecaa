"""The `verl-grpo` and `verl-dapo` presets against verl's vanilla PPO loss written out here in
float64 (ratio from log-probs clamped to [-20, 20], the clip [1 - 0.2, 1 + eps_high], the dual
clip at clip_ratio_c = 3 on negative advantages, the masked token mean), and GRPO advantages
with verl's rule for a group of one sample."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from bapo_megatron.algo import SearchPlan, bapo_loss, loss_normalizer
from bapo_megatron.algo.advantages import grpo_advantages
from bapo_megatron.config import ClipSearchConfig

VERL = {"verl-grpo": (0.2, 0.2), "verl-dapo": (0.2, 0.28)}  # clip_ratio_low, clip_ratio_high
CLIP_RATIO_C = 3.0


def verl_vanilla(logp_new, logp_old, advantages, mask, eps_low, eps_high):
    """verl's per-token PPO loss with its dual clip, token by token, and the masked mean."""
    losses, grads = [], torch.zeros_like(logp_new)
    for i, t in mask.nonzero().tolist():
        log_ratio = min(max(float(logp_new[i, t]) - float(logp_old[i, t]), -20.0), 20.0)
        r, a = math.exp(log_ratio), float(advantages[i, t])
        clipped = min(max(r, 1 - eps_low), 1 + eps_high)
        loss1, loss2 = -a * r, -a * clipped
        value = max(loss1, loss2)
        grad = -a * r if loss1 >= loss2 else 0.0  # the unclipped term wins ties
        if a < 0 and -a * CLIP_RATIO_C < value:
            value, grad = -a * CLIP_RATIO_C, 0.0
        losses.append(value)
        grads[i, t] = grad
    count = len(losses)
    return math.fsum(losses) / count, grads / count


@pytest.mark.parametrize("preset", sorted(VERL))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_preset_is_verls_vanilla_loss(preset, seed):
    g = torch.Generator().manual_seed(seed)
    n, s = 12, 20
    mask = torch.rand(n, s, generator=g) < 0.7
    logp_old = -torch.rand(n, s, generator=g, dtype=torch.float64) * 4
    # wide ratios: tokens on both sides of both bounds and past the dual clip
    logp_new = (
        logp_old + 0.8 * torch.randn(n, s, generator=g, dtype=torch.float64)
    ).requires_grad_()
    advantages = torch.randn(n, s, generator=g, dtype=torch.float64)
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset(preset))
    assert plan.is_fixed
    loss, metrics = bapo_loss(
        logp_new,
        logp_old,
        advantages,
        mask,
        plan=plan,
        normalizer=loss_normalizer(mask, "token-mean"),
        aggregation="token-mean",
        backend="torch",
    )
    loss.backward()
    want, want_grad = verl_vanilla(logp_new.detach(), logp_old, advantages, mask, *VERL[preset])
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(logp_new.grad, want_grad, rtol=1e-12, atol=1e-15)
    assert float(metrics["bapo/clip_frac_dual"]) > 0  # the dual clip acted on some token


@pytest.mark.parametrize("normalize_std", [True, False])
def test_a_group_of_one_gets_verls_advantage(normalize_std):
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(6, 1, generator=g, dtype=torch.float64)
    got = grpo_advantages(rewards, normalize_std=normalize_std, one_sample="reward")
    for row, (reward,) in enumerate(rewards.tolist()):
        mean, std = 0.0, 1.0  # verl's values for a group of one
        want = (reward - mean) / (std + 1e-6) if normalize_std else reward - mean
        assert float(got[row, 0]) == pytest.approx(want, rel=1e-15)
    assert grpo_advantages(rewards, normalize_std=normalize_std).eq(0).all()


def test_larger_groups_do_not_depend_on_the_one_sample_rule():
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(5, 4, generator=g, dtype=torch.float64)
    got = grpo_advantages(rewards, one_sample="reward")
    assert torch.equal(got, grpo_advantages(rewards))
    for row, values in enumerate(rewards.tolist()):
        want = [(v - statistics.fmean(values)) / (statistics.stdev(values) + 1e-6) for v in values]
        assert got[row].tolist() == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="one_sample must be"):
        grpo_advantages(rewards, one_sample="raw")
