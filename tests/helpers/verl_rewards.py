"""Reward functions written as verl writes them, for the tests that must run them unchanged
(named ``tests.helpers.verl_rewards:<function>`` in ``reward.name``): verl's signature, a dict
result with ``score``, dispatch on ``data_source`` as verl's ``default_compute_score`` does."""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Exact match for the `count_to` data set (with the row's index from ``extra_info`` and the
    answer as verl's ``pred``), the last word for `words`; any other data set is not
    implemented, as in verl."""
    if data_source == "count_to":
        right = solution_str.strip() == ground_truth.strip()
        index = -1 if extra_info is None else extra_info["index"]
        return {"score": float(right), "acc": right, "index": index, "pred": solution_str.strip()}
    if data_source == "words":
        words = solution_str.split()
        return {"score": float(bool(words) and words[-1] == ground_truth), "words": len(words)}
    raise NotImplementedError(f"Reward function is not implemented for {data_source=}")


def length_over_source(response: str, ground_truth: str, *, data_source=None) -> float:
    """Our signature with the row's ``data_source`` asked for: the response's length, doubled
    for the data set ``double``."""
    return float(len(response) * (2 if data_source == "double" else 1))
