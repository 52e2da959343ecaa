"""GRPO advantages: rewards normalized within each prompt's group of samples (pure functions)."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    one_sample: str = "zero",
) -> torch.Tensor:
    """Advantages of ``rewards`` [groups, n] (n samples of each prompt): r - mean of its group,
    divided by the group's standard deviation (unbiased) + ``eps`` when ``normalize_std``
    (Dr. GRPO's variant leaves it out). A group whose rewards are all equal gets zeros. A group
    of one sample (n = 1) gets zeros too, or with ``one_sample="reward"`` its raw reward
    (divided by 1 + ``eps`` under ``normalize_std``): verl's GRPO takes mean 0 and standard
    deviation 1 for such a group."""
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(
            f"rewards: expected shape [groups, samples per prompt], got {tuple(rewards.shape)}"
        )
    if one_sample not in ("zero", "reward"):
        raise ValueError(f"one_sample must be 'zero' or 'reward', got {one_sample!r}")
    if not rewards.is_floating_point():
        rewards = rewards.double()
    if rewards.shape[1] == 1 and one_sample == "reward":  # mean 0, standard deviation 1
        return rewards / (1.0 + eps) if normalize_std else rewards.clone()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)  # one sample: no spread to normalize by
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups] bool: groups whose rewards are not all equal (the others carry no gradient under
    group normalization and can be filtered, as DAPO's dynamic sampling does)."""
    return (rewards != rewards[:, :1]).any(dim=1)
