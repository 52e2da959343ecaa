"""Synthetic off-policy batches that look like stale GRPO data, for the loss demonstration and
the benchmarks (no model or data set needed).

Groups of G samples per prompt get binary rewards and group-normalised advantages (GRPO).
Wrong answers are longer, so negative-advantage tokens outnumber positive ones, as the paper
observes. Behaviour log-probs are mostly near 0 with a heavy tail of unlikely tokens. The
current policy has drifted for ``staleness`` updates since the data was sampled: it has pushed
the sampled tokens of positive samples up and those of negative samples down, unlikely tokens
fastest (their ratio moves most), plus noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OffPolicyBatch:
    logp_old: torch.Tensor  # [batch, tokens] behaviour log-probs
    logp_new: torch.Tensor  # [batch, tokens] current-policy log-probs
    advantages: torch.Tensor  # [batch] group-normalised
    mask: torch.Tensor  # [batch, tokens] response tokens


def off_policy_batch(
    prompts: int,
    group_size: int,
    max_tokens: int,
    *,
    staleness: float,
    accuracy: float = 0.4,
    drift_per_step: float = 0.08,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> OffPolicyBatch:
    """``prompts * group_size`` sequences of up to ``max_tokens`` response tokens."""
    g = torch.Generator().manual_seed(seed)
    batch = prompts * group_size
    correct = (torch.rand(prompts, group_size, generator=g) < accuracy).to(torch.float64)
    mean, std = correct.mean(-1, keepdim=True), correct.std(-1, keepdim=True)
    advantages = ((correct - mean) / (std + 1e-6)).reshape(batch)

    # Wrong answers run longer: lengths drawn from [0.2, 0.7] of max for right, [0.5, 1] for wrong.
    frac = torch.rand(batch, generator=g, dtype=torch.float64)
    frac = torch.where(advantages > 0, 0.2 + 0.5 * frac, 0.5 + 0.5 * frac)
    lengths = (frac * max_tokens).long().clamp(min=1)
    mask = torch.arange(max_tokens)[None, :] < lengths[:, None]

    logp_old = -(
        torch.empty(batch, max_tokens, dtype=torch.float64).exponential_(1.0, generator=g) ** 2
    )
    prob_old = logp_old.exp()
    direction = torch.sign(advantages)[:, None]
    noise = torch.randn(batch, max_tokens, generator=g, dtype=torch.float64)
    drift = staleness * drift_per_step * (direction * (1.0 - prob_old) * 2.0 + 0.5 * noise)
    logp_new = (logp_old + drift).clamp(max=0.0)
    return OffPolicyBatch(
        logp_old=logp_old.to(dtype),
        logp_new=logp_new.to(dtype),
        advantages=advantages.to(dtype),
        mask=mask,
    )
