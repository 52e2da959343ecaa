"""Named reward functions: ``(response text, ground truth) -> float``, or one of the other
signatures and results :mod:`bapo_megatron.rewards.calling` accepts (verl's ``compute_score``,
a dict with a ``score``).

Built-in rewards register themselves by name when their module is imported; any other function
is named ``"package.module:function"`` and imported on first use (also inside pool workers, which
do not share the parent's runtime registrations).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., Any]

_REWARDS: dict[str, RewardFn] = {}
_BUILTIN_MODULES = {
    "math": "bapo_megatron.rewards.math_answer",
    "math_lenient": "bapo_megatron.rewards.math_answer",
    "exact_match": "bapo_megatron.rewards.exact_match",
    "final_number": "bapo_megatron.rewards.final_number",
}
"""Built-in name -> the module that registers it, imported when the name is first asked for (a
reward worker for ``exact_match`` then starts without math-verify, 0.6 s of imports)."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``name``."""

    def register(fn: RewardFn) -> RewardFn:
        if name in _BUILTIN_MODULES:  # a clash with a built-in not imported yet is one too
            importlib.import_module(_BUILTIN_MODULES[name])
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return register


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name`` (a registered name or ``"module:function"``)."""
    if name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name in _REWARDS:
        return _REWARDS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"reward {name!r}: cannot import it ({err})") from None
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(
        f"unknown reward {name!r}; registered: {sorted({*_REWARDS, *_BUILTIN_MODULES})}, or give "
        "'package.module:function'"
    )
