"""How a reward function is called, and what its result means.

Three signatures are accepted, told apart by the function's parameter names
(``inspect.signature``), so that reward functions written for other trainers work unchanged:

- ours: ``fn(response, ground_truth)``, the two passed by position;
- ours with the row's description: as above, plus the keyword arguments ``data_source`` and
  ``extra_info`` when the function names them (or takes ``**kwargs``);
- verl's: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, recognised
  by its ``solution_str`` parameter, every argument passed by keyword (verl calls it so; a set
  mixing data sets dispatches on ``data_source``).

``data_source`` and ``extra_info`` are the prompt row's (None when it has none). The result is
a number, or, verl's convention, a dict with the number under ``score``: its other entries that
are finite numbers (booleans count as 0/1) are the check's metrics, logged by the trainer as
``reward/<key>``; entries of other kinds (verl's ``pred``, the extracted answer text) are not.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROW_KEYWORDS = ("data_source", "extra_info")
"""The row's fields a reward may ask for by naming them as parameters."""


@dataclass(frozen=True)
class RewardInput:
    """What one check is given."""

    response: str
    ground_truth: str
    data_source: str | None = None
    extra_info: dict | None = None


@dataclass(frozen=True)
class RewardOutcome:
    """One check's score and the metrics its result carried."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


def reward_caller(fn: Callable[..., Any]) -> Callable[[RewardInput], Any]:
    """A function calling ``fn`` with a :class:`RewardInput` in the signature it has (see the
    module docstring); its result is ``fn``'s, unread."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or extension function without a signature
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def accepts(name: str) -> bool:
        param = params.get(name)
        if param is None:
            return takes_any
        return param.kind is not inspect.Parameter.POSITIONAL_ONLY

    wanted = [name for name in ROW_KEYWORDS if accepts(name)]
    if "solution_str" in params:  # verl's compute_score

        def call_verl(given: RewardInput) -> Any:
            row = {name: getattr(given, name) for name in wanted}
            return fn(solution_str=given.response, ground_truth=given.ground_truth, **row)

        return call_verl

    def call(given: RewardInput) -> Any:
        row = {name: getattr(given, name) for name in wanted}
        return fn(given.response, given.ground_truth, **row)

    return call


def read_outcome(value: Any) -> RewardOutcome:
    """The :class:`RewardOutcome` of a reward's result; ``ValueError`` saying what is wrong
    when it is neither a finite number nor a dict with one under ``score``."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without a 'score' key (keys {sorted(value)})")
        for key, entry in value.items():
            if key == "score" or not isinstance(key, str):
                continue
            if isinstance(entry, (bool, int, float)) and math.isfinite(float(entry)):
                metrics[key] = float(entry)
        value = value["score"]
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {value!r}, not a number") from None
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    return RewardOutcome(score=score, metrics=metrics)
