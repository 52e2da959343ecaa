"""The load-balancing term against a float64 reference written token by token: its value, its
gradient, the shares of sequence-parallel ranks adding up to the whole, padding excluded, and
the backward-only attachment adding exactly d term / d parameters."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.actor.batch import PolicyBatch  # noqa: E402
from bapo_megatron.actor.moe_aux_loss import (  # noqa: E402
    _AddLossInBackward,
    load_balancing_loss,
    valid_tokens_sequence_major,
)

TOPK = 2


def reference(scores: torch.Tensor, valid: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_e f_e P_e, one token at a time, in float64."""
    scores = scores.double()
    num_experts = scores.shape[1]
    tokens = [t for t in range(scores.shape[0]) if valid[t]]
    counts = [0.0] * num_experts
    probability = [scores.new_zeros(()) for _ in range(num_experts)]
    for t in tokens:
        for e in torch.topk(scores[t], topk).indices.tolist():
            counts[e] += 1.0
        for e in range(num_experts):
            probability[e] = probability[e] + scores[t, e]
    n = len(tokens)
    return num_experts * sum(
        counts[e] / (topk * n) * probability[e] / n for e in range(num_experts)
    )


def random_scores(tokens: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(tokens, experts, generator=g, dtype=torch.float64), -1)


def test_value_and_gradient_match_the_token_by_token_reference():
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits.requires_grad_(True)
    valid = torch.tensor([True] * 7 + [False] * 3)
    got, tokens = load_balancing_loss(torch.softmax(logits, -1), valid, TOPK, lambda c: c)
    (grad_got,) = torch.autograd.grad(got, logits)
    want = reference(torch.softmax(logits, -1), valid, TOPK)
    (grad_want,) = torch.autograd.grad(want, logits)
    assert float(tokens) == 7
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-12, atol=1e-15)
    assert grad_got[7:].abs().max() == 0  # padding takes no part


def test_even_routing_gives_one():
    # 4 tokens, 4 experts, top-1, each token on its own expert with the same confidence
    scores = torch.full((4, 4), 0.1, dtype=torch.float64) + 0.6 * torch.eye(4, dtype=torch.float64)
    loss, _ = load_balancing_loss(scores, torch.ones(4, dtype=torch.bool), 1, lambda c: c)
    assert float(loss) == pytest.approx(1.0, abs=1e-15)


def test_sequence_parallel_shares_add_up_to_the_whole():
    scores = random_scores(12, 5, seed=2)
    valid = torch.ones(12, dtype=torch.bool)
    valid[10:] = False
    halves = [(scores[:6], valid[:6]), (scores[6:], valid[6:])]

    def local_counts(part_scores, part_valid):
        chosen = torch.zeros_like(part_scores).scatter_(1, part_scores.topk(TOPK, 1).indices, 1.0)
        w = part_valid.double()
        return torch.cat([(chosen * w[:, None]).sum(0), w.sum()[None]])

    total = sum(local_counts(*half) for half in halves)  # what the all-reduce returns
    shares = [load_balancing_loss(s, v, TOPK, lambda c: total.clone())[0] for s, v in halves]
    torch.testing.assert_close(sum(shares), reference(scores, valid, TOPK), rtol=1e-12, atol=0)


def test_a_microbatch_without_tokens_adds_nothing():
    scores = random_scores(4, 3, seed=3).requires_grad_(True)
    loss, tokens = load_balancing_loss(scores, torch.zeros(4, dtype=torch.bool), 1, lambda c: c)
    assert float(loss.detach()) == 0 and float(tokens) == 0
    loss.backward()
    assert scores.grad.abs().max() == 0


def test_attached_term_adds_its_gradient_in_backward():
    w = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    output = w * 3.0
    term = (w**2).sum()
    attached = _AddLossInBackward.apply(output, term)
    torch.testing.assert_close(attached, output)
    attached.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2,), 3.0, dtype=torch.float64) + 2 * w.detach())


class _Context:
    def __init__(self, sequence_parallel: bool, tp_rank: int = 0, tp_size: int = 1):
        self.config = type("P", (), {"sequence_parallel": sequence_parallel})()
        self.tp_rank, self.tp_size = tp_rank, tp_size


def test_real_tokens_in_the_routers_order():
    # 2 sequences of 4 columns: the first responds at columns 1-2 (column 3 is padding), the
    # second is an empty padding row
    mask = torch.tensor([[False, True, True, False], [False, False, False, False]])
    batch = PolicyBatch(tokens=torch.zeros(2, 4, dtype=torch.long), response_mask=mask)
    # [s, b] flattened: (s0,b0) (s0,b1) (s1,b0) (s1,b1) ...
    want = torch.tensor([True, False, True, False, True, False, False, False])
    assert torch.equal(valid_tokens_sequence_major(batch, _Context(False)), want)
    # sequence parallel rank 1 of 2 sees sequence positions 2-3
    assert torch.equal(valid_tokens_sequence_major(batch, _Context(True, 1, 2)), want[4:])
