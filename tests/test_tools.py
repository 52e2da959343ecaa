"""The benchmark script runs and reports what it promises (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_loss_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_bapo_loss.py"), "--sizes", "64K",
         "--repeats", "1", "--threads", "1"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    res = report["sizes"]["64K"]
    assert res["steps"] >= 20  # the data makes the search walk far, as the targets require
    assert res["reductions"]["b"] == 1 and res["reductions"]["c"] == res["steps"] + 1
    assert res["targets"]["bounds_agree_b_c"] is True
    assert {"b_over_a", "c_over_b"} <= set(res)


def test_actor_step_benchmark_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_actor_step.py"), "--layouts", "tp1",
         "--steps", "1", "--warmup", "1", "--sequences", "2", "--length", "16", "--layers", "2",
         "--hidden", "64", "--vocab", "128"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    report = json.loads(out.strip().splitlines()[-1])
    tp1 = report["layouts"]["tp1"]
    assert report["benchmark"] == "actor_step" and tp1["processes"] == 1
    assert tp1["step_ms"] > 0 and tp1["tokens_per_s"] > 0
    assert 0 < tp1["search_share"] < 1 and tp1["step_vs_fixed_clip"] > 0
