"""The KL term towards a reference policy: the estimators, the loss term and the reward penalty
against float64 formulas written here, and the train step with the term against a float64
reference (the bounds BAPO finds do not see the term)."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.reference import build_reference, copy_actor_weights
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.advantages import grpo_advantages
from bapo_megatron.algo.kl import kl_estimate, kl_loss_term, kl_penalized_rewards, sequence_kl
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import ClipSearchConfig, LossConfig
from bapo_megatron.config.kl import KLConfig
from tests.helpers import bapo_reference
from tests.unit.test_train_step import (
    float64_logprobs,
    make_actor,
    random_batch,
    reference_logits,
)


def _by_hand(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(pi || pi_ref) estimators of a token sampled from pi, in float64, from their
    definitions: k1 = log pi - log pi_ref, k2 = its square / 2,
    k3 = pi_ref/pi - 1 - log(pi_ref/pi)."""
    logp, ref = logp.double(), ref.double()
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return (logp - ref) ** 2 / 2
    ratio = torch.exp(ref) / torch.exp(logp)
    return ratio - 1 - torch.log(ratio)


def _random_logprobs(seed: int, shape=(6, 11)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 0.05
    ref = logp + 0.7 * torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.7
    mask[:, 0] = False
    return logp, ref.clamp(max=-1e-3), mask


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_and_their_gradients_match_float64(estimator):
    logp, ref, _ = _random_logprobs(1)
    logp32 = logp.float().requires_grad_(True)
    got = kl_estimate(logp32, ref.float(), estimator)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _by_hand(logp, ref, estimator), rtol=1e-5, atol=1e-6)
    got.sum().backward()
    d_logp = {
        "k1": torch.ones_like(logp),
        "k2": logp - ref,
        "k3": 1 - torch.exp(ref - logp),
    }[estimator]
    torch.testing.assert_close(logp32.grad.double(), d_logp, rtol=1e-5, atol=1e-6)
    if estimator != "k1":
        assert bool((got >= 0).all())  # k2 and k3 never negative
    # the reference is frozen: no gradient reaches it
    ref_leaf = ref.clone().requires_grad_(True)
    kl_estimate(logp.clone().requires_grad_(True), ref_leaf, estimator).sum().backward()
    assert ref_leaf.grad is None


def test_k3_is_unbiased_for_the_true_kl():
    """Sampled from pi, k1 and k3 average to KL(pi || pi_ref) of the two distributions."""
    g = torch.Generator().manual_seed(7)
    pi = torch.softmax(torch.randn(12, generator=g, dtype=torch.float64), 0)
    pi_ref = torch.softmax(torch.randn(12, generator=g, dtype=torch.float64), 0)
    exact = float((pi * (pi.log() - pi_ref.log())).sum())
    for estimator in ("k1", "k3"):
        expected = float((pi * kl_estimate(pi.log(), pi_ref.log(), estimator)).sum())
        assert expected == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_term_is_aggregated_as_the_policy_loss(aggregation):
    logp, ref, mask = _random_logprobs(2)
    coef, normalizer = 0.3, 40.0
    term, total = kl_loss_term(
        logp,
        ref,
        mask,
        coef=coef,
        estimator="k3",
        aggregation=aggregation,
        normalizer=normalizer,
    )
    k3 = torch.where(mask, _by_hand(logp, ref, "k3"), 0.0)
    if aggregation == "seq-mean-token-mean":
        numerator = (k3.sum(1) / mask.sum(1).clamp(min=1)).sum()
    else:
        numerator = k3.sum()
    assert float(term) == pytest.approx(coef * float(numerator) / normalizer, rel=1e-12)
    assert float(total) == pytest.approx(float(k3.sum()), rel=1e-12)


def test_reward_penalty_and_its_advantages():
    logp, ref, mask = _random_logprobs(3, shape=(8, 9))
    per_sequence = sequence_kl(logp, ref, mask, "k1")
    want = torch.where(mask, logp - ref, 0.0).sum(1)
    torch.testing.assert_close(per_sequence, want, rtol=1e-12, atol=1e-12)
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    scores = kl_penalized_rewards(rewards, per_sequence.view(2, 4), 0.05)
    torch.testing.assert_close(scores, rewards - 0.05 * want.view(2, 4), rtol=0, atol=1e-12)
    # a group of equal rewards gets advantages from the penalty alone
    assert grpo_advantages(scores).abs()[1].sum() > 0
    with pytest.raises(ValueError, match="do not match"):
        kl_penalized_rewards(rewards, per_sequence, 0.05)


def _with_reference(batch: PolicyBatch, logp64: torch.Tensor, seed: int) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    ref = logp64.detach().float() + 0.3 * torch.randn(batch.tokens.shape, generator=g)
    return PolicyBatch(
        tokens=batch.tokens,
        response_mask=batch.response_mask,
        old_logprobs=batch.old_logprobs,
        advantages=batch.advantages,
        ref_logprobs=torch.where(batch.response_mask, ref, 0.0),
    )


@pytest.mark.parametrize("granularity", ["step", "microbatch"])
def test_train_step_with_the_kl_loss_matches_float64_and_keeps_the_bounds(context, granularity):
    temperature, coef = 0.9, 0.25
    clip = ClipSearchConfig.from_preset("paper", granularity=granularity)
    plan = SearchPlan.from_config(clip)
    loss = LossConfig(clip=clip)
    kl = KLConfig(coef=coef, estimator="k3")
    # `microbatch`: one micro-batch, whose search sees the whole batch, as the reference's does
    size = 2 if granularity == "step" else 5
    actor = make_actor(context, micro_batch_size=size, temperature=temperature, clip_grad=0.0)
    plain_actor = make_actor(context, micro_batch_size=size, temperature=temperature, clip_grad=0.0)
    batch = random_batch(2, spread=0.6)
    logits = reference_logits(actor, batch.tokens)
    logp64, _ = float64_logprobs(logits, batch.tokens, temperature)
    batch = _with_reference(batch, logp64, 12)

    mask, old, adv = batch.response_mask, batch.old_logprobs.double(), batch.advantages.double()
    ref = batch.ref_logprobs.double()
    tokens = mask.sum()
    r = bapo_reference.ratio_of(logp64.detach(), old)
    chosen = bapo_reference.search(r, adv[:, None].expand_as(r), mask, clip)
    policy_loss, d_policy = bapo_reference.loss_and_grad(
        logp64.detach(), old, adv, mask, chosen.c_low, chosen.c_high, None, "token-mean", tokens
    )
    logp = logp64.detach()
    k3 = torch.exp(ref - logp) - 1 - (ref - logp)
    kl_mean = float(k3[mask].mean())
    d_kl = torch.where(mask, coef * (1 - torch.exp(ref - logp)) / tokens, 0.0)
    (logp64 * (d_policy + d_kl)).sum().backward()
    want_grad_norm = math.sqrt(
        sum(float(p.main_grad.double().pow(2).sum()) for p in actor.chunks[0].module.parameters())
    )

    with_kl = train_step(actor, batch, loss, plan, kl=kl)
    without = train_step(plain_actor, batch, loss, plan)
    assert with_kl["kl/mean"] == pytest.approx(kl_mean, rel=1e-5)
    assert with_kl["kl/loss"] == pytest.approx(coef * kl_mean, rel=1e-5)
    assert with_kl["loss"] == pytest.approx(float(policy_loss) + coef * kl_mean, rel=1e-5)
    assert with_kl["grad_norm"] == pytest.approx(want_grad_norm, rel=1e-5)
    # P and N count the policy-gradient tokens only: the same bounds, rho and search path
    assert chosen.steps > 0
    for key in [k for k in without if k.startswith("bapo/")]:
        assert with_kl[key] == without[key], key
    assert with_kl["bapo/c_low"] == pytest.approx(chosen.c_low, abs=1e-12)
    assert with_kl["bapo/c_high"] == pytest.approx(chosen.c_high, abs=1e-12)
    assert "kl/mean" not in without and with_kl["grad_norm"] != without["grad_norm"]


def test_reward_placement_trains_on_the_policy_loss_and_reports_the_kl(context):
    actor = make_actor(context, micro_batch_size=5)
    plain = make_actor(context, micro_batch_size=5)
    batch = random_batch(13)
    logp64, _ = float64_logprobs(reference_logits(actor, batch.tokens), batch.tokens, 0.9)
    batch = _with_reference(batch, logp64, 14)
    clip = ClipSearchConfig.from_preset("paper")
    plan, loss = SearchPlan.from_config(clip), LossConfig(clip=clip)
    got = train_step(actor, batch, loss, plan, kl=KLConfig(coef=0.5, placement="reward"))
    want = train_step(plain, batch, loss, plan)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert got["kl/loss"] == 0.0 and got["kl/mean"] > 0


def test_reference_built_on_the_actor_layout_gives_the_actor_logprobs(context):
    actor = make_actor(context, micro_batch_size=2)
    state = torch.random.get_rng_state()
    reference = build_reference(actor, offload=True)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run draws as without it
    copy_actor_weights(reference, actor)
    assert not any(p.requires_grad for p in reference.parameters().values())
    batch = random_batch(15)
    from bapo_megatron.actor.logprobs import compute_logprobs
    from bapo_megatron.actor.microbatches import Batching

    want, _ = compute_logprobs(
        actor.chunks, batch, context, batching=Batching(2), temperature=0.9, with_entropy=False
    )
    got = reference.logprobs(batch, batching=Batching(3), temperature=0.9)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # frozen: training the actor leaves the reference where it was
    clip = ClipSearchConfig.from_preset("paper")
    train_step(actor, batch, LossConfig(clip=clip), SearchPlan.from_config(clip))
    after = reference.logprobs(batch, batching=Batching(3), temperature=0.9)
    torch.testing.assert_close(after, want, rtol=0, atol=0)


def test_bad_kl_settings_name_the_field():
    with pytest.raises(ValueError, match=r"algorithm\.kl\.reference is null"):
        KLConfig(coef=0.1, reference=None)
    with pytest.raises(ValueError, match=r"algorithm\.kl\.coef"):
        KLConfig(coef=-1.0)
    with pytest.raises(ValueError, match=r"algorithm\.kl\.estimator"):
        KLConfig(estimator="low_var_kl")
    with pytest.raises(ValueError, match=r"algorithm\.kl\.placement"):
        KLConfig(placement="advantage")
    KLConfig(coef=0.0, reference=None)  # nothing to measure against, nothing applied: allowed
