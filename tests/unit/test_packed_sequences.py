"""Packed rows against padded rows in one process: the same sequences give the same log-probs,
entropy, loss, BAPO statistics, bounds, gradients and parameters after a step, for every
aggregation; a token budget splits them into micro-batches without truncating an over-long one.

The distributed layouts (TP2 with sequence parallelism, PP2, DP2 with uneven lengths and
balancing, EP2 with routing replay) are checked against the padded single-process run in
tests/distributed/test_train_layouts.py and test_moe_train_layouts.py.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching, build_microbatches, plan_groups
from bapo_megatron.actor.model import global_parameter_name, load_whole_model_weights
from bapo_megatron.actor.packing import Multiples, sequence_lengths, unpack_tokens
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    OptimizerConfig,
    check_training,
)
from bapo_megatron.config.loading import load_config
from tests.helpers.tiny_models import tiny_model
from tests.unit.test_config import TRAINABLE

MODEL = tiny_model(model_type="qwen2", vocab_size=96, max_position_embeddings=64)
OPTIMIZER = OptimizerConfig(lr=1e-3, clip_grad=0.0)
PARAM_TOLERANCE = 0.01 * OPTIMIZER.lr
"""Rounding of the parameters' update itself; 1% of it (as tests/distributed/test_train_layouts.py
allows)."""
COMPARED = (
    "loss",
    "grad_norm",
    "entropy",
    "response_tokens",
    "bapo/c_low",
    "bapo/c_high",
    "bapo/rho_before",
    "bapo/rho_after",
    "bapo/search_steps",
    "bapo/clip_frac_positive",
    "bapo/clip_frac_negative",
    "bapo/ratio_min",
    "bapo/ratio_max",
)


def long_tailed_batch(seed: int, n: int = 7, length: int = 40) -> PolicyBatch:
    """Right-padded sequences with a long tail: most end early, one runs to ``length``, one has
    no response token at all. Per-token advantages, mostly negative (the search moves the
    bounds), and importance weights."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, MODEL.vocab_size, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    ends = [length] + [int(torch.randint(6, 18, (), generator=g)) for _ in range(n - 1)]
    for i, end in enumerate(ends):
        prompt = int(torch.randint(2, 5, (), generator=g))
        if i != 3:  # row 3: a prompt without response tokens
            mask[i, prompt:end] = True
        tokens[i, end:] = 0
    old = torch.where(
        mask, -math.log(MODEL.vocab_size) + 0.5 * torch.randn(n, length, generator=g), 0.0
    )
    weights = torch.where(mask, torch.rand(n, length, generator=g) + 0.5, 0.0)
    return PolicyBatch(
        tokens=tokens,
        response_mask=mask,
        old_logprobs=old,
        advantages=torch.randn(n, length, generator=g) - 0.8,  # mostly negative: rho < rho0
        is_weights=weights,
    )


def actor_with(context, weights, **actor):
    built = build_actor(
        MODEL, ActorConfig(temperature=0.9, seed=5, **actor), OPTIMIZER, context
    )
    load_whole_model_weights(built.chunks, weights, context)
    return built


@pytest.fixture
def start_weights(context):
    """The initial weights every actor of a test starts from (loaded, so that packed and
    padded actors are the same model)."""
    actor = build_actor(MODEL, ActorConfig(seed=5), OPTIMIZER, context)
    return {
        global_parameter_name(chunk, name): param.detach().clone()
        for chunk in actor.chunks
        for name, param in chunk.module.named_parameters()
    }


def _step(actor, batch, aggregation, granularity):
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper", granularity=granularity))
    metrics = train_step(actor, batch, LossConfig(aggregation=aggregation), plan)
    grads = {
        global_parameter_name(chunk, name): param.main_grad.detach().clone()
        for chunk in actor.chunks
        for name, param in chunk.module.named_parameters()
    }
    params = {
        global_parameter_name(chunk, name): param.detach().clone()
        for chunk in actor.chunks
        for name, param in chunk.module.named_parameters()
    }
    return metrics, grads, params


def first_step_tolerance(got_grad: torch.Tensor, want_grad: torch.Tensor) -> torch.Tensor:
    """Per element, how far Adam's first step, ``lr * g / (|g| + eps)``, may move between two
    gradients that agree to float32 rounding: PARAM_TOLERANCE, plus their difference times the
    step's largest slope between them, ``lr * eps / (|g| + eps)^2`` at the smaller ``|g|`` (at
    0 where the signs differ). A component near ``eps`` turns rounding into a share of ``lr``;
    one well above it barely moves."""
    lr, eps = OPTIMIZER.lr, OPTIMIZER.adam_eps
    same_sign = torch.sign(got_grad) == torch.sign(want_grad)
    nearest = torch.where(same_sign, torch.minimum(got_grad.abs(), want_grad.abs()), 0.0)
    slope = lr * eps / (nearest.double() + eps) ** 2
    return PARAM_TOLERANCE + (got_grad - want_grad).abs().double() * slope


def _assert_same_step(packed, padded, what):
    (got, got_grads, got_params), (want, want_grads, want_params) = packed, padded
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), f"{what}: {key}"
    for name in want_grads:
        scale = float(want_grads[name].abs().max())
        grad_error = float((got_grads[name] - want_grads[name]).abs().max())
        assert grad_error <= 1e-5 * scale + 1e-7, f"{what}: grad {name} off by {grad_error:.3g}"
        param_error = (got_params[name] - want_params[name]).abs().double()
        allowed = first_step_tolerance(got_grads[name], want_grads[name])
        worst = int((param_error / allowed).argmax())
        assert param_error.flatten()[worst] < allowed.flatten()[worst], (
            f"{what}: {name} off by {float(param_error.flatten()[worst]):.3g}, "
            f"allowed {float(allowed.flatten()[worst]):.3g}"
        )


def test_packed_logprobs_and_entropy_equal_padded(context, start_weights):
    batch = long_tailed_batch(1)
    padded = actor_with(context, start_weights, micro_batch_size=2)
    want_lp, want_ent = compute_logprobs(
        padded.chunks, batch, context, batching=Batching(2), temperature=0.9
    )
    for batching in (Batching(3, pack=True), Batching(1, pack=True, max_tokens=48)):
        got_lp, got_ent = compute_logprobs(
            padded.chunks, batch, context, batching=batching, temperature=0.9
        )
        mask = batch.response_mask
        torch.testing.assert_close(got_lp[mask], want_lp[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_ent[mask], want_ent[mask], rtol=1e-5, atol=1e-5)
        # packed rows compute nothing after a sequence's last response token
        assert not got_lp[~mask].any() or bool((got_lp[3] == 0).all())


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
)
def test_packed_train_step_equals_padded(context, start_weights, aggregation):
    """Granularity `step` does not depend on the split, so a token budget (which regroups the
    sequences, one of them alone and over budget) must give the padded step's result."""
    batch = long_tailed_batch(2)
    padded = _step(
        actor_with(context, start_weights, micro_batch_size=2), batch, aggregation, "step"
    )
    budget = actor_with(
        context, start_weights, pack_sequences=True, max_tokens_per_microbatch=24
    )
    packed = _step(budget, batch, aggregation, "step")
    _assert_same_step(packed, padded, f"{aggregation}, token budget")
    assert packed[0]["actor/over_budget_sequences"] == 1.0  # the 40-token sequence
    assert packed[0]["num_microbatches"] > padded[0]["num_microbatches"] / 2
    assert packed[0]["actor/padding_share"] < padded[0]["actor/padding_share"]
    assert padded[0]["bapo/search_steps"] > 0  # the bounds moved: the comparison is not vacuous


def test_packed_microbatch_granularity_equals_padded(context, start_weights):
    """One decision per micro-batch: packed by count, micro-batch i holds the same sequences as
    padded micro-batch i (the row without response tokens aside, which decides nothing)."""
    batch = long_tailed_batch(3)
    keep = [i for i in range(batch.num_sequences) if i != 3]
    batch = PolicyBatch(
        **{
            f.name: getattr(batch, f.name)[keep]
            for f in dataclasses.fields(batch)
            if getattr(batch, f.name) is not None
        }
    )
    padded = _step(
        actor_with(context, start_weights, micro_batch_size=2), batch, "token-mean", "microbatch"
    )
    packed = _step(
        actor_with(context, start_weights, micro_batch_size=2, pack_sequences=True),
        batch,
        "token-mean",
        "microbatch",
    )
    _assert_same_step(packed, padded, "granularity microbatch")


def test_budget_split_builds_rows_within_budget():
    batch = long_tailed_batch(4)
    batching = Batching(pack=True, max_tokens=24)
    multiples = Multiples(sequence=4, row=16)  # TP4 under SP, and an FP8 recipe's 4 per rank
    groups = plan_groups(batch, batching, multiples)
    rows = build_microbatches(batch, groups, batching, multiples, groups.count + 2)
    lengths = sequence_lengths(batch)
    seen = sorted(r for mb in rows for r in mb.segments.sequences if r >= 0)
    assert seen == [i for i, length in enumerate(lengths) if length > 0]  # each once, row 3 out
    for mb in rows:
        real = [r for r in mb.segments.sequences if r >= 0]
        assert mb.tokens.shape[1] % 16 == 0
        spans = mb.segments.cu_seqlens[1:] - mb.segments.cu_seqlens[:-1]
        assert all(int(span) % 4 == 0 for span in spans)
        used = sum(int(span) for span, r in zip(spans, mb.segments.sequences) if r >= 0)
        assert used <= 24 or len(real) == 1  # only a lone sequence goes over
    assert all(not mb.response_mask.any() for mb in rows[-2:])  # the appended empty ones
    uniform = build_microbatches(
        batch, groups, batching, multiples, groups.count, groups.row_length
    )
    assert len({mb.tokens.shape[1] for mb in uniform}) == 1
    # the tokens and masks come back where they were
    tokens = unpack_tokens([mb.tokens for mb in rows], rows, tuple(batch.tokens.shape))
    kept = torch.arange(batch.tokens.shape[1])[None] < torch.tensor(lengths)[:, None]
    assert torch.equal(tokens[kept], batch.tokens[kept])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["actor.max_tokens_per_microbatch=256"],
            "actor.max_tokens_per_microbatch=256 fills packed rows by tokens and needs "
            "actor.pack_sequences: true",
        ),
        (
            ["actor.pack_sequences=true", "actor.logprob_max_tokens_per_microbatch=1"],
            "actor.logprob_max_tokens_per_microbatch must be an integer >= 2, got 1",
        ),
    ],
)
def test_bad_packing_fields_are_refused_naming_them(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            [
                "parallel.tensor_model_parallel_size=4",
                "parallel.sequence_parallel=true",
                "actor.max_tokens_per_microbatch=3",
            ],
            "actor.max_tokens_per_microbatch=3 is below the layout's length multiple 4",
        ),
        (
            ["parallel.context_parallel_size=2"],
            "actor.pack_sequences=true with parallel.context_parallel_size=2",
        ),
    ],
)
def test_packing_a_layout_cannot_run_is_refused_at_startup(overrides, message):
    cfg = load_config(None, TRAINABLE + ["actor.pack_sequences=true", *overrides])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_training(cfg)
