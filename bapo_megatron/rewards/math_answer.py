"""Math answers checked with math-verify: the response's final answer against the ground truth,
with numeric and symbolic equivalence (1/2 = 0.5 = \\frac{1}{2}).

math-verify parses LaTeX and plain expressions into sympy with its own grammar; nothing in a
response is executed. Its parser bounds its own time with ``signal.alarm``, which only works in
a process's main thread: run these through :class:`bapo_megatron.rewards.pool.RewardPool`,
whose workers call them in their main thread and are killed when a check overruns anyway.
"""

from __future__ import annotations

from math_verify import parse, verify

from bapo_megatron.rewards.registry import register_reward

BOXED = "\\boxed"
PARSE_SECONDS = 5


@register_reward("math")
def boxed_math_reward(response: str, ground_truth: str) -> float:
    """1.0 when the response's last ``\\boxed{...}`` answer equals the ground truth, else 0.0.
    A response without a boxed answer scores 0 (no guessing the last number in the text)."""
    if BOXED not in response:
        return 0.0
    return lenient_math_reward(response, ground_truth)


@register_reward("math_lenient")
def lenient_math_reward(response: str, ground_truth: str) -> float:
    """1.0 when the response's answer equals the ground truth, else 0.0. The answer is the last
    ``\boxed{...}`` when there is one, else what math-verify extracts (the last number or
    expression)."""
    if BOXED in response:
        response = response[response.rindex(BOXED) :]
    gold = parse(
        ground_truth if "$" in ground_truth or BOXED in ground_truth else f"${ground_truth}$",
        parsing_timeout=PARSE_SECONDS,
    )
    if not gold:
        raise ValueError(f"ground truth {ground_truth!r} cannot be parsed as a math answer")
    answer = parse(response, parsing_timeout=PARSE_SECONDS)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=PARSE_SECONDS) else 0.0
