"""The minimal staleness sweep end to end (shared warm-up start, two training subprocesses,
the report with a table row per run, the plots), and the sweep's plan."""

from __future__ import annotations

import json

import pytest

from bapo_megatron.sweep import METHODS, SweepSettings, plan_runs, staleness_overrides


def test_plan_covers_the_grid(tmp_path):
    settings = SweepSettings()
    runs = plan_runs(settings, tmp_path)
    assert len(runs) == 5 * 6 * 3
    assert len({run.output_dir for run in runs}) == len(runs)
    lag = next(r for r in runs if r.staleness == "lag16")
    assert "algorithm.rollout_lag=16" in lag.overrides and f"train.steps={settings.steps + 16}" in lag.overrides
    fixed = next(r for r in runs if r.method == "fixed-0.6")
    assert fixed.overrides[:3] == list(METHODS["fixed-0.6"])
    assert staleness_overrides("partial8", settings)[0] == "rollout.partial_tokens_per_round=8"
    with pytest.raises(ValueError):
        SweepSettings(staleness=("stale3",))
    with pytest.raises(ValueError):
        SweepSettings(methods=("ppo",))


def test_minimal_sweep_end_to_end(tmp_path):
    from bapo_megatron.sweep import run_sweep

    settings = SweepSettings.minimal()
    report = run_sweep(settings, tmp_path, progress=lambda line: None)
    text = report.read_text()
    runs = plan_runs(settings, tmp_path)
    for run in runs:
        assert json.loads((run.output_dir / "run.json").read_text())["returncode"] == 0
        assert any(line.startswith(f"| {run.method} | {run.seed} |") for line in text.splitlines())
    assert "## The paper's claims, as measured here" in text and "Failed runs" not in text
    for name in ("reward", "entropy", "positive_contribution", "clip_fractions", "grad_norm", "overview"):
        png = tmp_path / "plots" / "reuse4" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"plots/reuse4/{name}.png" in text
    assert "The sweep took" in text
    # a second call reuses the start and the finished runs: only the report is written again
    kept = {path: path.stat().st_mtime_ns for run in runs
            for path in (run.output_dir / "run.json", run.output_dir / "train.log",
                         tmp_path / "start" / "model" / "config.json")}
    run_sweep(settings, tmp_path, progress=lambda line: None)
    assert {path: path.stat().st_mtime_ns for path in kept} == kept
