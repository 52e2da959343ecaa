"""Metrics logger, phase timer and TensorBoard read-back."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from bapo_megatron.trainer.tracking import JSONL_NAME, MetricsLogger, PhaseTimer, read_scalars

TAGS = ("bapo/rho_after", "bapo/c_low", "reward/mean", "time/rollout")


def random_metrics(rng: random.Random) -> dict[str, float]:
    return {tag: rng.uniform(-5, 5) for tag in TAGS}


def f32(value: float) -> float:
    """What TensorBoard keeps of a float: its float32 rounding."""
    with np.errstate(over="ignore"):  # beyond float32's range: inf, as in TensorBoard
        return float(np.float32(value))


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def read_jsonl(log_dir) -> list[dict]:
    with (log_dir / JSONL_NAME).open() as f:
        return [json.loads(line) for line in f]


def log_steps(log_dir, steps, rng, **kwargs) -> dict[int, dict[str, float]]:
    logged = {}
    with MetricsLogger(log_dir, console=False, **kwargs) as logger:
        for step in steps:
            logged[step] = random_metrics(rng)
            logger.log(step, logged[step])
    return logged


def test_scalars_and_jsonl_read_back_what_was_logged(tmp_path):
    rng = random.Random(0)
    logged = log_steps(tmp_path, range(6), rng)
    logged[6] = {
        "bapo/rho_after": math.nan,
        "reward/mean": math.inf,
        "bapo/c_low": -math.inf,
        "time/rollout": 1e300,
    }  # beyond float32: TensorBoard keeps inf
    with MetricsLogger(tmp_path, console=False) as logger:  # a second session, appending
        logger.log(6, logged[6])

    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == sorted(TAGS)
    for tag, points in scalars.items():
        assert [step for step, _ in points] == list(range(7))
        for step, value in points:
            assert same(value, f32(logged[step][tag])), (tag, step, value)
    assert scalars["time/rollout"][6] == (6, math.inf)

    records = read_jsonl(tmp_path)  # full float64, NaN/inf as Python's json writes them
    assert [record.pop("step") for record in records] == list(range(7))
    for record, step in zip(records, range(7)):
        assert list(record) == list(logged[step])
        assert all(same(record[k], logged[step][k]) for k in record)


def test_values_accepted_and_refused(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(
            0,
            {
                "a/int": 3,
                "a/bool": True,
                "a/np": np.float32(0.5),
                "a/tensor": torch.tensor(0.25, dtype=torch.float64),
                "a/tensor1": torch.tensor([2.0]),
            },
        )
        for bad in ("0.5", None, [1.0], torch.ones(2), 1j):
            with pytest.raises(ValueError, match="a/bad"):
                logger.log(1, {"a/ok": 1.0, "a/bad": bad})
        with pytest.raises(ValueError, match="'step'"):
            logger.log(1, {"step": 1.0})
    # a refused call writes nothing, not even its valid values
    assert read_jsonl(tmp_path) == [
        {"step": 0, "a/int": 3.0, "a/bool": 1.0, "a/np": 0.5, "a/tensor": 0.25, "a/tensor1": 2.0}
    ]
    assert "a/ok" not in read_scalars(tmp_path)
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(2, {"a/int": 1.0})


def test_purge_step_drops_what_the_crashed_run_wrote_from_both_records(tmp_path):
    rng = random.Random(1)
    crashed = log_steps(tmp_path, range(10), rng)
    (old_events,) = tmp_path.glob("events.out.tfevents.*")
    with (tmp_path / JSONL_NAME).open("a") as f:
        f.write('{"step": 10, "reward/me')  # cut short by the kill
    resumed = log_steps(tmp_path, [5, 6], rng, purge_step=5)

    scalars = read_scalars(tmp_path)
    want = {step: crashed[step] for step in range(5)} | resumed
    for tag in TAGS:  # every tag, the ones the resumed run has not written yet included
        assert scalars[tag] == [(step, f32(want[step][tag])) for step in sorted(want)]
    assert [record["step"] for record in read_jsonl(tmp_path)] == [0, 1, 2, 3, 4, 5, 6]
    assert read_jsonl(tmp_path)[5] == {"step": 5, **resumed[5]}

    # The purge is a marker the reader honours, not an edit: the crashed run's event file still
    # holds its steps 5..9, and a raw event iterator sees them.
    raw_steps = {
        event.step for event in EventFileLoader(str(old_events)).Load() if event.HasField("summary")
    }
    assert raw_steps == set(range(10))


def test_resume_without_purge_keeps_the_last_value_written_per_step(tmp_path):
    rng = random.Random(2)
    crashed = log_steps(tmp_path, range(4), rng)
    resumed = log_steps(tmp_path, [2], rng)
    # TensorBoard's reader returns both runs' step-2 points; read_scalars keeps the later one,
    # and steps the resumed run has not reached (3) stay from the crashed run
    points = read_scalars(tmp_path)["reward/mean"]
    assert points == [
        (0, f32(crashed[0]["reward/mean"])),
        (1, f32(crashed[1]["reward/mean"])),
        (2, f32(resumed[2]["reward/mean"])),
        (3, f32(crashed[3]["reward/mean"])),
    ]
    assert [record["step"] for record in read_jsonl(tmp_path)] == [0, 1, 2, 3, 2]


def test_disabled_logger_writes_and_prints_nothing(tmp_path, capsys):
    log_dir = tmp_path / "run"
    logger = MetricsLogger(log_dir, enabled=False, purge_step=0)
    logger.log(0, {"reward/mean": 1.0, "bad": "not checked on idle ranks"})
    logger.close()
    assert not log_dir.exists()
    assert capsys.readouterr().out == ""


def test_console_only_logger_prints_one_line_per_step(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with MetricsLogger(None) as logger:
        logger.log(3, {"reward/mean": 0.5, "bapo/rho_after": 0.25})
        logger.log(4, {"reward/mean": 0.75}, total_steps=10)
    assert capsys.readouterr().out == "step 3 | reward 0.50 | rho 0.25\nstep 4/10 | reward 0.75\n"
    assert list(tmp_path.iterdir()) == []


def test_console_line_shows_the_values():
    logger = MetricsLogger(None, console=False)
    metrics = {
        "reward/mean": 0.41,
        "bapo/rho_after": 0.38,
        "bapo/c_low": 0.62,
        "bapo/c_high": 1.35,
        "entropy": 0.91,
        "grad_norm": 0.12,
        "response_length/mean": 14.2,
        "bapo/clip_frac_positive": 0.5,
        "time/rollout": 1.2,
        "time/train": 1.5,
        "time/step": 3.1,
    }
    assert logger.console_line(12, metrics, total_steps=200) == (
        "step 12/200 | reward 0.41 | rho 0.38 | c 0.62/1.35 | entropy 0.91 | grad 0.12 | "
        "len 14.2 | 3.1 s (rollout 1.2, train 1.5)"
    )
    assert logger.console_line(1, {"grad_norm": 3e-4, "bapo/c_high": 2.0}) == (
        "step 1 | c 2.00 | grad 3.00e-04"
    )
    custom = MetricsLogger(None, console=False, console_keys=["bapo/clip_frac_positive"])
    assert custom.console_line(0, metrics) == "step 0 | bapo/clip_frac_positive 0.50"


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phase_timer_sums_phases_with_a_fake_clock():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    assert timer.metrics() == {}
    with timer.phase("rollout"):
        clock.now += 1.25
    with timer.phase("train"):
        clock.now += 2.0
        with timer.phase("weight_sync"):  # nested: reported, not counted twice in the step
            clock.now += 0.5
    clock.now += 10.0  # outside any phase
    with pytest.raises(RuntimeError), timer.phase("rollout"):  # a raising block still counts
        clock.now += 0.75
        raise RuntimeError
    assert timer.metrics() == {
        "time/rollout": 2.0,
        "time/train": 2.5,
        "time/weight_sync": 0.5,
        "time/step": 4.5,
    }
    assert list(timer.metrics()) == ["time/rollout", "time/train", "time/weight_sync", "time/step"]
    timer.reset()
    with timer.phase("train"):
        clock.now += 1.0
    assert timer.metrics() == {"time/train": 1.0, "time/step": 1.0}
    with pytest.raises(ValueError, match="reserved"), timer.phase("step"):
        pass
    with pytest.raises(ValueError, match="already running"), timer.phase("a"), timer.phase("a"):
        pass


def test_atomic_text_write_gives_the_umask_mode_not_mkstemps(tmp_path):
    from bapo_megatron.files.atomic import write_text_atomically

    previous = os.umask(0o027)
    try:
        write_text_atomically(tmp_path / "report.json", "{}\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "report.json").read_text() == "{}\n"
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o640
