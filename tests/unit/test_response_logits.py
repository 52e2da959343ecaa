"""Logits at the response-predicting positions only: the same log-probs, entropies and parameter
gradients as logits at every position, padded and packed, with tied and untied output layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import token_logprobs
from bapo_megatron.actor.microbatches import Batching, build_microbatches, plan_groups
from bapo_megatron.actor.packing import Multiples
from bapo_megatron.actor.pipeline_schedule import run_schedule
from bapo_megatron.actor.response_logits import predicting_rows, scatter_rows
from bapo_megatron.config import ActorConfig, OptimizerConfig
from tests.helpers.tiny_models import tiny_model

MODEL = tiny_model(vocab_size=96, max_position_embeddings=64)


def test_rows_and_scatter_against_a_loop():
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(4, 9, generator=g) < 0.5
    mask[:, 0] = False
    rows = predicting_rows(mask)
    b, s = mask.shape
    want = [t * b + i for t in range(s) for i in range(b) if t + 1 < s and mask[i, t + 1]]
    assert rows.tolist() == want
    values = torch.randn(len(want), generator=g)
    got = scatter_rows(values, rows, (b, s))
    expected = torch.zeros(b, s)
    for value, flat in zip(values.tolist(), want):
        t, i = divmod(flat, b)
        expected[i, t + 1] = value
    assert torch.equal(got, expected)
    assert torch.equal(got != 0, mask)


def _batch(seed: int) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    n, length = 5, 16
    tokens = torch.randint(0, MODEL.vocab_size, (n, length), generator=g)
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):
        start = int(torch.randint(3, 8, (), generator=g))
        end = int(torch.randint(start + 1, length + 1, (), generator=g))
        mask[i, start:end] = True
    return PolicyBatch(tokens=tokens, response_mask=mask)


def _run(actor, context, batch, batching, every_position):
    """Per-token log-probs and entropy ([n, s] per micro-batch) and the parameter gradients
    of a loss weighing every response token's log-prob and entropy with fixed random weights."""
    groups = plan_groups(batch, batching, Multiples())
    microbatches = build_microbatches(batch, groups, batching, Multiples(), groups.count)
    g = torch.Generator().manual_seed(11)
    weights = [torch.randn(mb.tokens.shape, generator=g) for mb in microbatches]
    index = iter(range(len(microbatches)))

    def per_microbatch(microbatch, logits):
        logp, entropy = token_logprobs(
            logits, microbatch.tokens, context, temperature=0.8, with_entropy=True
        )
        mask = microbatch.response_mask
        w = weights[next(index)]
        loss = (torch.where(mask, logp * w, 0.0) + torch.where(mask, entropy * w, 0.0)).sum()
        return loss, {
            "logp": torch.where(mask, logp, 0.0).detach(),
            "entropy": torch.where(mask, entropy, 0.0).detach(),
        }

    for chunk in actor.chunks:
        chunk.zero_grad_buffer()
    outputs = run_schedule(
        actor.chunks,
        microbatches,
        per_microbatch,
        context,
        forward_only=False,
        every_position=every_position,
    )
    grads = {name: p.main_grad.clone() for name, p in actor.chunks[0].module.named_parameters()}
    return outputs, grads


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pack", [False, True])
def test_cut_logits_equal_every_position(context, tied, pack):
    model = dataclasses.replace(MODEL, tie_word_embeddings=tied)
    actor = build_actor(
        model, ActorConfig(micro_batch_size=2, seed=2), OptimizerConfig(lr=1e-3), context
    )
    batch = _batch(7 + tied + 2 * pack)
    batching = Batching(2, pack=True, max_tokens=40) if pack else Batching(2)
    want, want_grads = _run(actor, context, batch, batching, every_position=True)
    got, got_grads = _run(actor, context, batch, batching, every_position=False)
    assert len(got) == len(want) > 1
    for a, b in zip(got, want):
        for key in ("logp", "entropy"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        assert grad.abs().sum() > 0, name  # every parameter takes part, so the check bites
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6)
