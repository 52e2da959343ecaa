"""Granularity `step` skips its extra no-grad forward pass where the result is known: the first
mini-batch after old log-probs were recomputed with the current weights (every ratio is 1), and
a step of one micro-batch (its loss searches on the step's own statistics). Each skip must give
the step the forward pass gives: the same bounds and metrics, the same parameters afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bapo_megatron.actor import train_step as train_step_module  # noqa: E402
from bapo_megatron.actor.logprobs import compute_logprobs  # noqa: E402
from bapo_megatron.actor.microbatches import Batching  # noqa: E402
from bapo_megatron.actor.model import global_parameter_name, load_whole_model_weights  # noqa: E402
from bapo_megatron.actor.train_step import train_step  # noqa: E402
from bapo_megatron.algo.search_plan import SearchPlan  # noqa: E402
from bapo_megatron.config import ClipSearchConfig, LossConfig  # noqa: E402
from tests.unit.test_train_step import make_actor, random_batch  # noqa: E402


def same_weights_actors(context, micro_batch_size: int):
    """Two actors with the same weights (and fresh optimizers)."""
    first = make_actor(context, micro_batch_size=micro_batch_size)
    weights = {
        global_parameter_name(c, n): p.detach().clone()
        for c in first.chunks
        for n, p in c.module.named_parameters()
    }
    second = make_actor(context, micro_batch_size=micro_batch_size)
    load_whole_model_weights(second.chunks, weights, context)
    return first, second


def parameters(actor) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in actor.chunks[0].module.parameters()])


def count_forward_only(monkeypatch) -> list[int]:
    """Counts the train step's forward-only schedule runs (the extra pass) into the list."""
    calls = []
    original = train_step_module.run_schedule

    def counted(chunks, microbatches, per_microbatch, context, forward_only, **kwargs):
        calls.append(int(forward_only))
        return original(
            chunks, microbatches, per_microbatch, context, forward_only=forward_only, **kwargs
        )

    monkeypatch.setattr(train_step_module, "run_schedule", counted)
    return calls


def long_failures(batch):
    """Advantages that make negatives dominate: the short sequences positive, the long ones
    negative, so that rho < rho0 at ratio 1 and the search moves the bounds."""
    lengths = batch.response_mask.sum(-1).double()
    advantages = torch.where(lengths <= lengths.median(), 1.0, -1.0)
    return dataclasses.replace(batch, advantages=advantages)


def assert_same_step(skipped: dict, forward: dict) -> None:
    assert skipped["bapo/c_low"] == forward["bapo/c_low"]
    assert skipped["bapo/c_high"] == forward["bapo/c_high"]
    assert skipped["bapo/search_steps"] == forward["bapo/search_steps"]
    for key, value in forward.items():
        assert skipped[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_first_minibatch_after_recompute_skips_the_forward_and_equals_it(context, monkeypatch):
    clip = ClipSearchConfig.from_preset("paper", granularity="step")
    plan = SearchPlan.from_config(clip)
    skipping, forwarding = same_weights_actors(context, micro_batch_size=2)
    batch = long_failures(random_batch(7, n=6, length=16))
    recomputed, _ = compute_logprobs(
        skipping.chunks, batch, context, batching=Batching(2), temperature=0.9, with_entropy=False
    )
    batch = dataclasses.replace(batch, old_logprobs=torch.where(batch.response_mask, recomputed, 0))
    calls = count_forward_only(monkeypatch)

    forward = train_step(forwarding, batch, LossConfig(clip=clip), plan, skip_known_forward=False)
    assert calls == [1, 0]  # the extra pass, then forward/backward
    # what the skip relies on: the forward pass finds every ratio exactly 1
    assert forward["bapo/ratio_min"] == forward["bapo/ratio_max"] == 1.0
    assert forward["bapo/rho_before"] < 0.4 and forward["bapo/search_steps"] > 0

    calls.clear()
    skipped = train_step(skipping, batch, LossConfig(clip=clip), plan, ratios_are_one=True)
    assert calls == [0]  # forward/backward only
    assert_same_step(skipped, forward)
    assert torch.equal(parameters(skipping), parameters(forwarding))


@pytest.mark.parametrize("preset", ["paper", "reference"])
def test_one_microbatch_step_searches_in_its_loss_and_equals_the_forward(
    context, monkeypatch, preset
):
    clip = ClipSearchConfig.from_preset(preset, granularity="step")
    plan = SearchPlan.from_config(clip)
    skipping, forwarding = same_weights_actors(context, micro_batch_size=6)
    batch = random_batch(8, n=6, length=16, spread=0.6)  # stale: ratios spread around 1
    calls = count_forward_only(monkeypatch)
    forward = train_step(forwarding, batch, LossConfig(clip=clip), plan, skip_known_forward=False)
    assert forward["num_microbatches"] == 1 and forward["bapo/search_steps"] > 0
    assert calls == [1, 0]
    calls.clear()
    skipped = train_step(skipping, batch, LossConfig(clip=clip), plan)
    assert calls == [0]
    assert_same_step(skipped, forward)
    assert torch.equal(parameters(skipping), parameters(forwarding))


def test_several_microbatches_of_stale_data_still_pay_the_forward(context, monkeypatch):
    clip = ClipSearchConfig.from_preset("paper", granularity="step")
    actor = make_actor(context, micro_batch_size=2)
    calls = count_forward_only(monkeypatch)
    train_step(actor, random_batch(9, n=5), LossConfig(clip=clip), SearchPlan.from_config(clip))
    assert calls == [1, 0]
