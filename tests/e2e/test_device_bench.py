"""The device benchmarks (``python -m bapo_megatron.device_bench.run``, ``bapo-gpu-bench`` on a
GPU) in their CPU size, so that they cannot rot between GPU runs."""

from __future__ import annotations

import json

from bapo_megatron.device_bench import run
from tests.helpers.gloo_launch import ONE_THREAD

# loss_bench and packing_bench only wrap tools/bench_bapo_loss.py and bench_actor_step.py, whose
# smoke tests are in test_tools.py; memory needs torch.cuda
FAST_BENCHMARKS = "engine,speed"


def test_the_benchmarks_run_on_the_cpu_and_write_their_report(tmp_path, monkeypatch):
    for name, value in ONE_THREAD.items():  # the benchmark processes inherit one thread each
        monkeypatch.setenv(name, value)
    status = run.main(
        ["--device", "cpu", "--out", str(tmp_path), "--only", FAST_BENCHMARKS, "--label", "cpu"]
    )
    report = json.loads((tmp_path / "device_bench-cpu.json").read_text())
    assert status == 0, json.dumps(report["checks"], indent=1)[-6000:]
    engine, speed = report["checks"]["engine"], report["checks"]["speed"]
    assert engine["generated_tokens"] > 0 and engine["tokens_per_s"] > 0
    assert set(speed["step_seconds"]) == {"paper/microbatch", "paper/step", "grpo/microbatch"}
    assert speed["actor_tokens_per_s"] > 0 and speed["transformers_sdpa_tokens_per_s"] > 0
    assert speed["model_flops_per_token"] > 0
    assert speed["actor_mfu"] is None  # no peak FLOPs on the CPU
    table = (tmp_path / "device_bench-cpu.md").read_text()
    assert table.startswith("# Device benchmarks cpu")
    assert "| engine | passed |" in table and "| speed | passed |" in table
