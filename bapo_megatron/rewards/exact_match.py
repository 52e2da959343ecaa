"""Exact-match reward for tasks with one right response (the synthetic `count_to` task)."""

from __future__ import annotations

from bapo_megatron.rewards.registry import register_reward


@register_reward("exact_match")
def exact_match_reward(response: str, ground_truth: str) -> float:
    """1.0 when the response, without surrounding whitespace, equals the ground truth."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
