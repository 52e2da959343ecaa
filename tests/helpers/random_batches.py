"""Fresh random off-policy batches with varied staleness, lengths, advantage mixes and ratio
spreads, for comparing the package with the reference."""

from __future__ import annotations

import torch

SEARCH_VARIANTS = [
    # (preset, overrides) covering both schedules, semantics, units, with and without dual clip.
    ("paper", {}),
    ("reference", {}),
    ("paper", {"semantics": "surrogate"}),
    ("reference", {"semantics": "gradient"}),
    ("paper", {"target_unit": "ratio", "target": 0.9}),
    ("reference", {"target_unit": "share", "target": 0.45}),
    ("paper", {"dual_clip": 3.0}),
    ("reference", {"dual_clip": None}),
    ("paper", {"schedule": "reference"}),
    ("reference", {"schedule": "paper"}),
    ("reference", {"c_high_step": 0.3, "c_low_step": 0.07}),  # clamped last steps
    ("grpo", {}),
    ("clip-higher", {}),
]


def random_batch(
    seed: int, dtype=torch.float64, batch: int | None = None, tokens: int | None = None
):
    """One batch: dict of logp_old, logp_new (leaf, requires grad), advantages, mask."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=dtype)  # noqa: E731
    batch = batch or int(torch.randint(2, 24, (1,), generator=g))
    tokens = tokens or int(torch.randint(1, 64, (1,), generator=g))
    lengths = torch.randint(0, tokens + 1, (batch,), generator=g)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    staleness = float(torch.randint(0, 9, (1,), generator=g))
    spread = 0.05 + 0.4 * float(rand(1)) * (1 + staleness) / 4
    logp_old = -torch.empty(batch, tokens, dtype=dtype).exponential_(1.0, generator=g) * 2
    mix = float(rand(1))
    per_token_adv = bool(torch.randint(0, 2, (1,), generator=g))
    shape = (batch, tokens) if per_token_adv else (batch,)
    advantages = torch.randn(*shape, generator=g, dtype=dtype) + (mix - 0.6)
    zero = rand(*shape) < 0.1  # some zero advantages
    advantages = torch.where(zero, torch.zeros_like(advantages), advantages)
    sign = torch.sign(advantages if per_token_adv else advantages[:, None].expand(batch, tokens))
    drift = spread * (torch.randn(batch, tokens, generator=g, dtype=dtype) + 0.5 * sign)
    logp_new = (logp_old + drift).detach().requires_grad_(True)
    return {"logp_old": logp_old, "logp_new": logp_new, "advantages": advantages, "mask": mask}
