"""The synthetic `count_up_and_stop` task (rows, warm-up references that run on to the cap) and
the figures that say whether a run has BAPO's premise (:mod:`bapo_megatron.repro.task_figures`)
and how its bounds moved (:mod:`bapo_megatron.trainer.run_summary`)."""

from __future__ import annotations

import json
import random

import pytest

from bapo_megatron.data.prompts import prompt_token_ids
from bapo_megatron.data.synthetic_task import (
    COUNT_UP_DISTANCE,
    MAX_NUMBER,
    RUN_ON_SHARE,
    count_response,
    count_up_and_stop_rows,
    counting_tokenizer,
    run_on_response,
    synthetic_rows,
    warmup_reference,
)
from bapo_megatron.repro.task_figures import read_records, task_figures
from bapo_megatron.rewards.registry import get_reward
from bapo_megatron.trainer.run_summary import RunSummary, bounds_moved


def test_rows_count_upwards_a_short_distance():
    rows = count_up_and_stop_rows(300, seed=4)
    assert rows == synthetic_rows(
        "count_up_and_stop", 300, seed=4
    ) and rows != count_up_and_stop_rows(300, seed=5)
    tokenizer = counting_tokenizer()
    for row in rows:
        start, target = map(int, row.prompt.split(">"))
        assert 0 <= start <= MAX_NUMBER and 1 <= target - start <= COUNT_UP_DISTANCE
        assert row.answer == count_response(start, target)
        assert tokenizer.decode(prompt_token_ids(tokenizer, row)) == row.prompt + ":"


def test_run_on_reference_counts_past_the_target_to_the_cap_and_is_wrong():
    row = count_up_and_stop_rows(1, seed=0)[0]
    start = int(row.prompt.split(">")[0])
    text = run_on_response(row, 32)
    assert len(text) == 32 and text.startswith(row.answer + " ")
    # the numbers counted, the last one possibly cut by the cap
    numbers = text.split(" ")
    assert numbers[:-1] == [str(n) for n in range(start + 1, start + len(numbers))]
    assert str(start + len(numbers)).startswith(numbers[-1])
    assert get_reward("exact_match")(text, row.answer) == 0.0
    assert run_on_response(row, 5) == text[:5]


def test_warmup_reference_runs_on_for_its_share_of_count_up_and_stop_examples_only():
    rows = count_up_and_stop_rows(2000, seed=1)
    rng = random.Random(0)
    references = [warmup_reference("count_up_and_stop", row, rng, 32) for row in rows]
    run_ons = [ends for _, ends in references].count(False)
    assert run_ons / len(rows) == pytest.approx(RUN_ON_SHARE, abs=0.03)
    for row, (text, ends) in zip(rows, references):
        assert (text, ends) == ((row.answer, True) if ends else (run_on_response(row, 32), False))
    count_to = synthetic_rows("count_to", 50, seed=1)
    assert all(warmup_reference("count_to", r, rng, 32) == (r.answer, True) for r in count_to)


def _update(rollout_step, rho, c_low=0.6, c_high=1.2, positive=1.0):
    return {
        "step": 0,
        "rollout_step": rollout_step,
        "bapo/rho_before": rho,
        "bapo/c_low": c_low,
        "bapo/c_high": c_high,
        "bapo/positive_contribution": positive,
        "bapo/negative_contribution": 1.0,
    }


def _rollout(step, accuracy, right, wrong, at_cap):
    return {
        "step": step,
        "rollout_step": step,
        "reward/mean": accuracy,
        "reward/accuracy": accuracy,
        "response_length/right": right,
        "response_length/wrong": wrong,
        "rollout/wrong_truncated_fraction": at_cap,
    }


def test_task_figures_of_the_first_half(tmp_path):
    records = [
        {"step": -1, "warmup/cross_entropy": 1.0},
        _update(0, 0.2, c_high=3.0),
        _update(0, 0.3, c_low=0.9, c_high=3.0),
        _rollout(1, 0.25, 6.0, 20.0, 0.5),
        _update(1, 0.5),
        _update(1, 0.1, positive=0.0),
        _rollout(2, 0.75, 8.0, 16.0, 0.0),
        # second half: not measured
        _update(2, 0.1),
        _rollout(3, 0.5, 100.0, 100.0, 1.0),
        _update(3, 0.1),
        _rollout(4, 0.5, 100.0, 100.0, 1.0),
    ]
    records[5]["bapo/negative_contribution"] = 0.0  # all advantages zero: no rho to count
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    figures = task_figures(read_records(tmp_path), rho0=0.4, c_low=0.6, c_high=1.2)
    assert (figures.rollout_steps, figures.optimizer_steps) == (2, 4)
    # right: weights 0.25 and 0.75; wrong: 0.75 and 0.25
    assert figures.length_right == pytest.approx((0.25 * 6 + 0.75 * 8) / 1.0)
    assert figures.length_wrong == pytest.approx((0.75 * 20 + 0.25 * 16) / 1.0)
    assert figures.wrong_to_right_length == pytest.approx(19.0 / 7.5)
    assert figures.wrong_at_cap == pytest.approx(0.75 * 0.5)
    assert figures.rho_below_target == pytest.approx(2 / 3)  # 3 informative updates
    assert figures.moved_when_below == 1.0 and figures.moved == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        read_records(tmp_path / "missing")


def test_run_summary_counts_moves_with_rounding_and_reports_the_rewards():
    summary = RunSummary(c_low=0.8, c_high=1.2, rewards=[0.1, 0.2, 0.3, 0.5])
    assert not bounds_moved({"bapo/c_low": 0.7999999999999999, "bapo/c_high": 1.2}, 0.8, 1.2)
    summary.add_update(_update(0, 0.2, c_low=0.7999999999999999), rho0=0.4)
    summary.add_update(_update(0, 0.3, c_high=1.25), rho0=0.4)
    summary.add_update(_update(0, 0.5, c_high=1.25), rho0=0.4)
    summary.add_update({"loss": 1.0}, rho0=0.4)  # no search metrics: not an update to count
    lines = summary.lines(0.4)
    assert lines[0] == "mean reward of the first 2 rollout steps 0.150, of the last 2 0.400"
    assert lines[1] == (
        "bounds moved off 0.8/1.2 in 2/3 optimizer steps (67%), in 1/2 of those with rho "
        "before the search < 0.4; mean c_high 1.233"
    )
    assert lines[2].startswith("wall time 0 min ") and "GB" in lines[2]
