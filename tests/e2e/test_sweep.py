"""A minimal staleness sweep end to end (shared warm-up start, a one-process run and an
asynchronous run under torchrun side by side, the report with a table row per run, the plots),
the report's claims over several methods, and the sweep's plan."""

from __future__ import annotations

import json
import threading

import pytest

from bapo_megatron.repro.sweep import (
    METHODS,
    ProcessSlots,
    SweepSettings,
    plan_runs,
    staleness_overrides,
    training_command,
)


def test_plan_covers_the_grid(tmp_path):
    settings = SweepSettings()
    runs = plan_runs(settings, tmp_path)
    assert len(runs) == 5 * 8 * 3  # reuse 1/4/8, lag 8/16, async 1/2/4 (partial: on request)
    assert len({run.output_dir for run in runs}) == len(runs)
    lag = next(r for r in runs if r.staleness == "lag16")
    assert (
        "algorithm.rollout_lag=16" in lag.overrides
        and f"train.steps={settings.steps + 16}" in lag.overrides
    )
    fixed = next(r for r in runs if r.method == "fixed-0.6")
    assert fixed.overrides[:3] == list(METHODS["fixed-0.6"])
    assert staleness_overrides("partial8", settings)[0] == "rollout.partial_tokens_per_round=8"
    # the asynchronous pipeline: one trainer and one engine rank under torchrun, m = 1 so that
    # eta = k generates k rollout steps ahead
    async2 = next(r for r in runs if r.staleness == "async2")
    assert {
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        "algorithm.max_staleness=2",
        "algorithm.optimizer_steps_per_rollout=1",
        f"train.steps={settings.steps}",
    } <= set(async2.overrides)
    command = training_command(tmp_path / "base.yaml", async2)
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert "torch.distributed.run" not in training_command(tmp_path / "base.yaml", lag)
    with pytest.raises(ValueError):
        SweepSettings(staleness=("stale3",))
    with pytest.raises(ValueError):
        SweepSettings(methods=("ppo",))
    with pytest.raises(ValueError):
        SweepSettings(staleness=("async0",))


def test_process_slots_hold_a_two_process_run_alone():
    slots = ProcessSlots(2)
    assert slots.acquire(1) == 1
    # an async run waits until the single-process run gives its slot back
    waiting = threading.Thread(target=slots.acquire, args=(2,))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()
    slots.release(1)
    waiting.join(60)
    assert not waiting.is_alive() and slots._free == 0
    slots.release(2)
    assert ProcessSlots(1).acquire(2) == 1  # capped: never waits for more slots than exist


def test_minimal_sweep_end_to_end(tmp_path):
    """One method at two staleness settings, one of them asynchronous: every step of the sweep
    (start, both kinds of run, report, plots, the second call) without paying for a second
    method's runs, whose only other use is the comparison in the claims (tested below on
    made-up summaries). 3 slots: the one-process run beside the two-process one."""
    from bapo_megatron.repro.sweep import run_sweep

    settings = SweepSettings.minimal(methods=("bapo-paper",), jobs=3)
    report = run_sweep(settings, tmp_path, progress=lambda line: None)
    text = report.read_text()
    runs = plan_runs(settings, tmp_path)
    for run in runs:
        assert json.loads((run.output_dir / "run.json").read_text())["returncode"] == 0
        assert any(line.startswith(f"| {run.method} | {run.seed} |") for line in text.splitlines())
    assert "## The paper's claims, as this sweep measured them" in text
    assert "Failed runs" not in text
    for name in (
        "reward",
        "entropy",
        "positive_contribution",
        "clip_fractions",
        "grad_norm",
        "overview",
    ):
        for staleness in settings.staleness:
            png = tmp_path / "plots" / staleness / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
            assert f"plots/{staleness}/{name}.png" in text
    assert "The sweep took" in text
    # the async1 runs went through the asynchronous pipeline, within their bound
    assert "async1" in settings.staleness
    for run in (r for r in runs if r.staleness == "async1"):
        records = [
            json.loads(line)
            for line in (run.output_dir / "tensorboard" / "metrics.jsonl").read_text().splitlines()
        ]
        assert all(r["async/dropped_groups"] == 0 for r in records if "reward/mean" in r)
        updates = [r for r in records if "staleness/max" in r]
        assert len(updates) == settings.steps and all(r["staleness/max"] <= 1 for r in updates)
    assert "Staleness of the trained tokens" in text
    # a second call reuses the start and the finished runs: only the report is written again
    kept = {
        path: path.stat().st_mtime_ns
        for run in runs
        for path in (
            run.output_dir / "run.json",
            run.output_dir / "train.log",
            tmp_path / "start" / "model" / "config.json",
        )
    }
    run_sweep(settings, tmp_path, progress=lambda line: None)
    assert {path: path.stat().st_mtime_ns for path in kept} == kept


def test_summary_leaves_updates_without_advantaged_tokens_out_of_rho_and_grad_norm(tmp_path):
    from bapo_megatron.repro.sweep_report import summarize_run

    def update(step, rho, grad, positive, negative, met=1.0):
        return {
            "step": step,
            "epoch": 0,
            "entropy": 0.5,
            "grad_norm": grad,
            "bapo/rho_after": rho,
            "bapo/rho_before": rho,
            "bapo/target_met": met,
            "bapo/positive_tokens": positive,
            "bapo/negative_tokens": negative,
            "bapo/clip_frac_positive": 0.0,
            "bapo/clip_frac_negative": 0.0,
        }

    rollout = {
        "step": 1,
        "reward/mean": 0.5,
        "reward/accuracy": 0.5,
        "response_length/right": 3.0,
        "response_length/wrong": 5.0,
        "rollout/truncated_fraction": 0.0,
    }
    records = [
        rollout,
        update(1, 0.5, 2.0, 3, 4),
        update(2, 0.0, 0.0, 0, 0),
        update(3, 0.3, 4.0, 1, 6, met=0.0),
        update(4, 0.0, 0.0, 0, 0),
    ]
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    summary = summarize_run(tmp_path)
    assert summary["mean_rho"] == pytest.approx(0.4)  # (0.5 + 0.3) / 2, not / 4
    assert summary["rho_at_target"] == pytest.approx(0.5)
    assert summary["search_target_met"] == pytest.approx(0.5)
    assert summary["rho_before_below_target"] == pytest.approx(0.5)
    assert summary["median_grad_norm"] == pytest.approx(3.0)
    assert summary["updates_without_signal"] == pytest.approx(0.5)
    assert summary["optimizer_steps"] == 4


def test_claims_compare_each_bapo_preset_with_every_fixed_clip_method():
    """The claims' verdicts by seed means, per staleness setting: a BAPO preset wins a setting
    only against every fixed-clip method there, a tie is no win, and a setting without both
    kinds is left out."""
    from bapo_megatron.repro.sweep_report import claims

    def summary(entropy, reward, grad, rho=0.5):
        return {
            "rho_before_below_target": 0.25,
            "entropy_last": entropy,
            "mean_rho": rho,
            "rho_at_target": 1.0,
            "search_target_met": 0.75,
            "max_grad_norm": grad,
            "median_grad_norm": grad / 2,
            "final_reward": reward,
        }

    groups = {
        "reuse4": {
            "grpo": [summary(0.5, 0.5, 3.0, rho=0.3)],
            "clip-higher": [summary(0.6, 0.5, 2.0, rho=0.3)],
            "bapo-paper": [summary(0.7, 0.6, 1.0)],
            "bapo-reference": [summary(0.55, 0.7, 2.5)],  # beats grpo only: no win
        },
        "async1": {
            "grpo": [summary(0.4, 0.4, 1.0), summary(0.4, 0.6, 1.0)],  # two seeds
            "bapo-paper": [summary(0.45, 0.5, 2.0)],  # reward and rho tied with grpo's
        },
    }
    entropy, rho, grad, reward = claims(groups)[1:]
    assert entropy.endswith(
        "Ending with higher entropy: bapo-paper beat every fixed-clip method in 2 of 2 "
        "settings; bapo-reference beat every fixed-clip method in 0 of 1 settings."
    )
    assert "reuse4: grpo 0.500, clip-higher 0.600, bapo-paper 0.700" in entropy
    assert rho.endswith(
        "Higher mean rho: bapo-paper beat every fixed-clip method in 1 of 2 settings; "
        "bapo-reference beat every fixed-clip method in 1 of 1 settings."
    )
    assert "reuse4: bapo-paper 0.75, bapo-reference 0.75; async1: bapo-paper 0.75" in rho
    assert "Lower max grad norm: bapo-paper beat every fixed-clip method in 1 of 2" in grad
    assert "async1: grpo 1.00/0.50, bapo-paper 2.00/1.00" in grad
    assert "async1: grpo 0.500 (seeds 0.400..0.600), bapo-paper 0.500 (one seed" in reward
    assert (
        "Higher final reward: bapo-paper beat every fixed-clip method in 1 of 2 settings; "
        "bapo-reference beat every fixed-clip method in 1 of 1 settings (ties do not count)"
    ) in reward
    alone = claims({"reuse1": {"bapo-paper": [summary(0.5, 0.5, 1.0)]}})
    assert all("no BAPO and fixed-clip pair to compare" in line for line in alone[1:])
