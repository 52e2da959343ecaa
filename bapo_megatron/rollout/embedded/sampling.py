"""Draw the next token of every row and its behaviour log-prob (pure tensor functions)."""

from __future__ import annotations

import torch


def next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [rows, vocab].

    Returns ``(tokens [rows] int64, logprobs [rows] float32)`` where the log-prob is that of the
    full-vocabulary distribution softmax(logits / temperature), before top-k/top-p truncation
    (see :mod:`bapo_megatron.rollout.protocol`). The token is drawn from that distribution
    restricted to the top-k tokens and the top-p nucleus, renormalized.
    """
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    filtered = logprobs
    if top_k and top_k < logprobs.shape[-1]:
        kth = logprobs.topk(top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = filtered.sort(dim=-1, descending=True)
        # Probability mass before each token in descending order; keep while it is < top_p,
        # so the token that crosses top_p is kept (and the top token always is).
        mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
