"""The actor's train step and forward-only pass in one process, against float64 references.

The reference takes the model's logits for the whole batch in one plain forward, computes
log-probs and entropy in float64, picks the bounds with the step-by-step search of
tests/helpers/bapo_reference.py, and gets the loss and its gradient w.r.t. the log-probs by
hand; the parameter gradient is that pushed back through the model with autograd. The train
step runs through Megatron's schedule, DDP buffers and optimizer on split micro-batches.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch, split_microbatches
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.model import global_parameter_name, load_whole_model_weights
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    OptimizerConfig,
)
from tests.helpers import bapo_reference
from tests.helpers.tiny_models import tiny_model

MODEL = tiny_model(vocab_size=96, max_position_embeddings=64)


def make_actor(context, micro_batch_size=2, temperature=0.9, **optimizer):
    actor = build_actor(
        MODEL,
        ActorConfig(micro_batch_size=micro_batch_size, temperature=temperature, seed=5),
        OptimizerConfig(**{"lr": 1e-3, **optimizer}),
        context,
    )
    return actor


def random_batch(seed: int, n: int = 5, length: int = 14, spread: float = 0.5) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL.vocab_size, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):
        start = int(torch.randint(2, 6, (), generator=g))
        end = int(torch.randint(start + 1, length + 1, (), generator=g))
        mask[i, start:end] = True
    # Old log-probs near a typical value for this vocabulary, so ratios spread around 1.
    old = torch.where(
        mask, -math.log(MODEL.vocab_size) + spread * torch.randn(n, length, generator=g), 0.0
    )
    return PolicyBatch(
        tokens=tokens, response_mask=mask, old_logprobs=old, advantages=torch.randn(n, generator=g)
    )


def reference_logits(actor, tokens):
    [chunk] = actor.chunks
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return chunk.module(tokens, positions, None)


def float64_logprobs(logits, tokens, temperature):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)[:, :-1]
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros(tokens.shape[0], 1, dtype=torch.float64)
    return torch.cat([zero, logp], 1), torch.cat([zero, entropy], 1)


def test_forward_only_logprobs_match_float64(context):
    actor = make_actor(context, micro_batch_size=2, temperature=0.7)
    batch = random_batch(1)
    with torch.no_grad():
        want_logp, want_entropy = float64_logprobs(
            reference_logits(actor, batch.tokens), batch.tokens, 0.7
        )
    logp, entropy = compute_logprobs(
        actor.chunks,
        PolicyBatch(tokens=batch.tokens, response_mask=batch.response_mask),
        context,
        batching=Batching(2),
        temperature=0.7,
    )
    assert logp.shape == entropy.shape == batch.tokens.shape
    # only the positions that predict a response token are computed; the others hold 0
    mask = batch.response_mask
    torch.testing.assert_close(logp.double()[mask], want_logp[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double()[mask], want_entropy[mask], rtol=1e-5, atol=1e-5)
    assert not logp[~mask].any() and not entropy[~mask].any()


@pytest.mark.parametrize("preset", ["paper", "reference"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_step_granularity_matches_float64_reference(context, preset, aggregation):
    temperature = 0.9
    actor = make_actor(context, micro_batch_size=2, temperature=temperature, clip_grad=0.0)
    clip = ClipSearchConfig.from_preset(preset, granularity="step")
    batch = random_batch(2, spread=0.6)

    logits = reference_logits(actor, batch.tokens)
    logp64, entropy64 = float64_logprobs(logits, batch.tokens, temperature)
    mask, old, adv = batch.response_mask, batch.old_logprobs.double(), batch.advantages.double()
    r = bapo_reference.ratio_of(logp64.detach(), old)
    chosen = bapo_reference.search(r, adv[:, None].expand_as(r), mask, clip)
    assert chosen.steps > 0  # the data makes the search move, or the check would be weak
    normalizer = mask.sum() if aggregation == "token-mean" else (mask.sum(-1) > 0).sum()
    want_loss, d_logp = bapo_reference.loss_and_grad(
        logp64.detach(),
        old,
        adv,
        mask,
        chosen.c_low,
        chosen.c_high,
        clip.dual_clip,
        aggregation,
        normalizer,
    )
    (logp64 * d_logp).sum().backward()
    # DDP accumulates into its fp32 buffer (main_grad); the train step zeroes it first.
    want_grad_norm = math.sqrt(
        sum(float(p.main_grad.double().pow(2).sum()) for p in actor.chunks[0].module.parameters())
    )

    metrics = train_step(
        actor, batch, LossConfig(aggregation=aggregation, clip=clip), SearchPlan.from_config(clip)
    )
    assert metrics["bapo/c_low"] == pytest.approx(chosen.c_low, abs=1e-12)
    assert metrics["bapo/c_high"] == pytest.approx(chosen.c_high, abs=1e-12)
    assert metrics["bapo/search_steps"] == chosen.steps
    assert metrics["bapo/rho_before"] == pytest.approx(chosen.rho_before, rel=1e-5)
    assert metrics["bapo/rho_after"] == pytest.approx(chosen.rho_after, rel=1e-5)
    assert metrics["loss"] == pytest.approx(want_loss.detach().item(), rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(want_grad_norm, rel=1e-5)
    assert metrics["entropy"] == pytest.approx(entropy64[mask].mean().item(), rel=1e-5)
    assert metrics["response_tokens"] == int(mask.sum())
    assert metrics["num_microbatches"] == 3 and metrics["skipped"] == 0.0
    r_resp = r[mask]
    assert metrics["bapo/ratio_min"] == pytest.approx(float(r_resp.min()), rel=1e-5)
    assert metrics["bapo/ratio_max"] == pytest.approx(float(r_resp.max()), rel=1e-5)


def test_micro_batch_split_does_not_change_the_step(context):
    """Granularity `step`, token-mean: micro-batches of 1, 2 or 5 sequences give the same step."""
    batch = random_batch(3, n=5)
    clip = ClipSearchConfig.from_preset("paper")
    plan = SearchPlan.from_config(clip)
    weights, results = None, []
    for micro_batch_size in (1, 2, 5):
        actor = make_actor(context, micro_batch_size=micro_batch_size)
        if weights is None:
            weights = {
                global_parameter_name(c, n): p.detach().clone()
                for c in actor.chunks
                for n, p in c.module.named_parameters()
            }
        load_whole_model_weights(actor.chunks, weights, context)
        metrics = [train_step(actor, batch, LossConfig(clip=clip), plan) for _ in range(2)]
        params = torch.cat([p.detach().reshape(-1) for p in actor.chunks[0].module.parameters()])
        results.append((metrics, params))
    (first_metrics, first_params), *others = results
    for metrics, params in others:
        for got, want in zip(metrics, first_metrics):
            for key in ("loss", "grad_norm", "bapo/c_high", "bapo/c_low", "entropy"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        # Adam can turn rounding in near-zero gradient components into update-sized
        # differences: 1% of the most a parameter moves in 2 steps of lr 1e-3.
        assert (params - first_params).abs().max() < 0.01 * 1e-3 * 2


def test_non_finite_gradient_skips_the_update_and_counts(context):
    actor = make_actor(context, lr=1e-2)
    batch = random_batch(4)
    clip = ClipSearchConfig.from_preset("grpo")
    plan = SearchPlan.from_config(clip)
    params = list(actor.chunks[0].module.parameters())
    before = [p.detach().clone() for p in params]
    target = actor.chunks[0].module.decoder.layers[0].mlp.linear_fc2.weight
    handle = target.register_hook(lambda grad: grad * float("nan"))
    metrics = train_step(actor, batch, LossConfig(clip=clip), plan)
    handle.remove()
    assert metrics["skipped"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert not math.isfinite(metrics["grad_norm"])
    assert all(torch.equal(p, b) for p, b in zip(params, before))

    metrics = train_step(actor, batch, LossConfig(clip=clip), plan)
    assert metrics["skipped"] == 0.0 and metrics["skipped_steps"] == 1.0
    assert math.isfinite(metrics["grad_norm"])
    assert any(not torch.equal(p, b) for p, b in zip(params, before))


def test_gradient_clipping_and_learning_rate_schedule(context):
    actor = make_actor(
        context,
        lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=6,
        lr_decay_style="linear",
        clip_grad=1e-3,
        weight_decay=0.0,
    )
    batch = random_batch(5)
    clip = ClipSearchConfig.from_preset("grpo")
    plan = SearchPlan.from_config(clip)
    lrs = []
    for step in range(7):
        metrics = train_step(actor, batch, LossConfig(clip=clip), plan)
        lrs.append(metrics["lr"])
        if step == 0:
            # Adam's first moment after one step is (1 - beta1) x the clipped gradient, whose
            # global norm is the clip value (the raw norm is far above it).
            assert metrics["grad_norm"] > 1.0
            states = [
                state
                for inner in actor.optimizer.chained_optimizers
                for state in inner.optimizer.state.values()
            ]
            moment_norm = math.sqrt(
                sum(float(st["exp_avg"].double().pow(2).sum()) for st in states)
            )
            assert moment_norm == pytest.approx((1 - 0.9) * 1e-3, rel=1e-4)
    # Megatron's convention: warmup from 0 over 2 steps, then linear decay to min_lr at step 6.
    want = [0.0, 5e-3, 1e-2, 1e-2 - 9e-3 / 4, 1e-2 - 2 * 9e-3 / 4, 1e-2 - 3 * 9e-3 / 4, 1e-3]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_bad_batches_are_refused_by_field(context):
    actor = make_actor(context)
    batch = random_batch(6)
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
    with pytest.raises(ValueError, match="batch.old_logprobs is required"):
        train_step(
            actor,
            PolicyBatch(
                tokens=batch.tokens, response_mask=batch.response_mask, advantages=batch.advantages
            ),
            LossConfig(),
            plan,
        )
    with pytest.raises(ValueError, match="batch.response_mask: expected shape"):
        PolicyBatch(tokens=batch.tokens, response_mask=batch.response_mask[:, 1:])
    with pytest.raises(ValueError, match="batch.response_mask: expected a bool"):
        PolicyBatch(tokens=batch.tokens, response_mask=batch.response_mask.int())
    with pytest.raises(ValueError, match="column 0"):
        PolicyBatch(tokens=batch.tokens, response_mask=torch.ones_like(batch.response_mask))
    with pytest.raises(ValueError, match="batch.advantages"):
        dataclasses.replace(batch, advantages=torch.zeros(3))
    with pytest.raises(ValueError, match="batch.tokens: expected integer"):
        PolicyBatch(tokens=batch.tokens.float(), response_mask=batch.response_mask)
    bad = batch.old_logprobs.clone()
    bad[tuple(batch.response_mask.nonzero()[0].tolist())] = float("nan")
    with pytest.raises(ValueError, match="logp_old: 1 non-finite"):
        train_step(actor, dataclasses.replace(batch, old_logprobs=bad), LossConfig(), plan)
    empty = batch.select(slice(0, 0))
    with pytest.raises(ValueError, match="no data-parallel rank has any sequence"):
        train_step(actor, empty, LossConfig(), plan)


def test_split_microbatches_pads_to_equal_shapes():
    batch = random_batch(7, n=3, length=7)
    parts = split_microbatches(batch, micro_batch_size=2, num_microbatches=3, seq_multiple=4)
    assert [p.tokens.shape for p in parts] == [(2, 8)] * 3
    assert torch.equal(parts[0].tokens[:, :7], batch.tokens[:2])
    assert torch.equal(parts[1].tokens[0, :7], batch.tokens[2])
    assert not parts[1].response_mask[1].any() and not parts[2].response_mask.any()
    assert parts[2].advantages.shape == (2,) and (parts[2].advantages == 0).all()
    with pytest.raises(ValueError, match="do not fit"):
        split_microbatches(batch, micro_batch_size=1, num_microbatches=2)


def test_bf16_parameters_train_with_fp32_main_weights(context):
    """Megatron's bf16 mode: bf16 parameters and activations, fp32 main weights in the optimizer;
    the step agrees with the fp32 model's at bf16 precision."""
    batch = random_batch(8)
    clip = ClipSearchConfig.from_preset("paper")
    plan = SearchPlan.from_config(clip)
    fp32 = make_actor(context)
    weights = {
        global_parameter_name(c, n): p.detach().clone()
        for c in fp32.chunks
        for n, p in c.module.named_parameters()
    }
    want = train_step(fp32, batch, LossConfig(clip=clip), plan)
    bf16 = build_actor(
        dataclasses.replace(MODEL, params_dtype="bfloat16"),
        ActorConfig(micro_batch_size=2, temperature=0.9, seed=5),
        OptimizerConfig(lr=1e-3),
        context,
    )
    load_whole_model_weights(bf16.chunks, weights, context)
    named = dict(bf16.chunks[0].module.named_parameters())
    params = list(named.values())
    # Every parameter is bf16, the local spec's RMSNorm weights too (as Transformer Engine's):
    # Megatron's optimizers cannot checkpoint a bf16 model with float32 parameters.
    assert {n for n, p in named.items() if p.dtype != torch.bfloat16} == set()
    before = [p.detach().clone() for p in params]
    got = train_step(bf16, batch, LossConfig(clip=clip), plan)
    assert got["skipped"] == 0.0
    for key in ("loss", "grad_norm", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=0.05, abs=1e-3), key
    main = [
        p
        for inner in bf16.optimizer.chained_optimizers
        for group in inner.optimizer.param_groups
        for p in group["params"]
    ]
    assert main and all(p.dtype == torch.float32 for p in main)
    assert any(not torch.equal(p, b) for p, b in zip(params, before))
