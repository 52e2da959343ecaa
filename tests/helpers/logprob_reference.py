"""Plain float64 log-probs and entropy with autograd, the reference of the vocab-parallel
log-probs (tests/distributed/test_vocab_parallel.py and test_vocab_parallel_shards.py), and the
package's own beside it."""

from __future__ import annotations

import torch

from bapo_megatron.algo.vocab_parallel import token_logprobs_and_entropy

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 log-probs and entropy of softmax(logits / T) over the first ``vocab_size``
    columns (autograd-able; padded columns get no gradient)."""
    z = logits.to(torch.float64)[..., : vocab_size or logits.shape[-1]] / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def reference_with_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    x = logits.detach().to(torch.float64).requires_grad_(True)
    logp, ent = reference(x, targets, temperature, vocab_size)
    loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if w_ent is not None else 0.0)
    loss.backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "grad": x.grad}


def ours_with_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
    **kwargs,
) -> dict:
    x = logits.detach().clone().requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(
        x, targets, temperature=temperature, with_entropy=w_ent is not None, **kwargs
    )
    loss = (logp * w_logp.to(logp.dtype)).sum()
    if w_ent is not None:
        loss = loss + (ent * w_ent.to(ent.dtype)).sum()
    loss.backward()
    return {"logp": logp.detach(), "entropy": None if ent is None else ent.detach(), "grad": x.grad}


def random_inputs(
    seed: int,
    shape: tuple[int, ...],
    vocab: int,
    scale: float = 3.0,
    target_limit: int | None = None,
):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, target_limit or vocab, shape, generator=g)
    w_logp = torch.randn(shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(shape, generator=g, dtype=torch.float64)
    return logits, targets, w_logp, w_ent


def assert_close(got, want, rtol, atol, what):
    torch.testing.assert_close(
        got.to(torch.float64), want, rtol=rtol, atol=atol, msg=lambda m: f"{what}\n{m}"
    )
