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
