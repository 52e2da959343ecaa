"""The device check (``python -m bapo_megatron.device_check.run``, ``bapo-gpu-check`` on a GPU)
in its CPU size, so that it cannot rot between GPU runs, and its verdicts on constructed runs."""

from __future__ import annotations

import copy
import json

from bapo_megatron.device_bench.run import BENCH_HEADLINES
from bapo_megatron.device_check import run
from bapo_megatron.device_check.compare import compare_actor_runs, summary_markdown
from tests.helpers.gloo_launch import ONE_THREAD

# packing's module runs in process below; the benchmarks: test_device_bench.py
FAST_CHECKS = "actor_tiny,actor_moe,conversion"


def test_the_check_runs_on_the_cpu_and_writes_its_report(tmp_path, monkeypatch):
    # The orchestrator in this process (its command line is `sys.exit(main())`): it only starts
    # the check processes, which inherit one thread each from this environment.
    for name, value in ONE_THREAD.items():
        monkeypatch.setenv(name, value)
    status = run.main(
        ["--device", "cpu", "--out", str(tmp_path), "--only", FAST_CHECKS, "--check-timeout", "240"]
    )
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert status == 0, json.dumps(report["checks"], indent=1)[-6000:]
    assert {n: r["status"] for n, r in report["checks"].items()} == dict.fromkeys(
        FAST_CHECKS.split(","), "passed"
    )
    actor = report["checks"]["actor_tiny"]
    # float32 on the CPU against float32 on the CPU: the same numbers
    for variant in actor["variants"].values():
        assert (
            variant["within_tolerance"] and variant["device_losses"] == variant["reference_losses"]
        )
    assert report["checks"]["conversion"]["round_trip_mismatched"] == []
    assert report["environment"]["device"] == "cpu" and report["not_run"]
    table = (tmp_path / "device_check.md").read_text()
    assert all(f"| {name} | passed |" in table for name in FAST_CHECKS.split(","))


def _run(loss: float, grad_norm: float, c_high: float) -> dict:
    step = {
        "loss": loss,
        "entropy": 5.0,
        "grad_norm": grad_norm,
        "bapo/c_low": 0.6,
        "bapo/c_high": c_high,
    }
    return {
        "dtype": "bfloat16",
        "model": {"model_type": "qwen2", "num_layers": 2, "hidden_size": 8, "vocab_size": 16},
        "tokens_per_step": 64,
        "variants": [{"variant": "paper/step", "steps": [step], "tokens_per_s": 1.0}],
    }


def test_bf16_runs_are_judged_by_the_stated_tolerances():
    reference = _run(0.80, 1.00, 1.20)
    assert compare_actor_runs(_run(0.81, 1.05, 1.22), reference, bf16=True)["status"] == "passed"
    for off in (_run(0.85, 1.00, 1.20), _run(0.80, 1.20, 1.20), _run(0.80, 1.00, 1.30)):
        assert compare_actor_runs(off, reference, bf16=True)["status"] == "failed"
    # a float32 device run must match to 1e-5
    assert compare_actor_runs(_run(0.8001, 1.0, 1.2), reference, bf16=False)["status"] == "failed"
    # nothing to compare is no pass
    other = copy.deepcopy(reference)
    other["variants"][0]["variant"] = "reference/step"
    assert compare_actor_runs(_run(0.80, 1.0, 1.2), other, bf16=True)["status"] == "failed"


def test_the_summary_names_every_check_and_what_was_not_run():
    report = {
        "label": "x",
        "environment": {
            "device": "cpu",
            "date": "d",
            "commit": "c",
            "torch": "t",
            "megatron_core": "m",
            "transformers": "tr",
        },
        "wall_s": 1.0,
        "checks": {
            "engine": {"status": "passed", "seconds": 1.0, "tokens_per_s": 12.0},
            "memory": {"status": "error", "seconds": 2.0, "error": "Boom: out of | memory"},
        },
        "not_run": {"TE": "cannot be carried"},
    }
    text = summary_markdown(report, "Device benchmarks", BENCH_HEADLINES)
    assert "| engine | passed | 1.0 | 12 tokens/s |" in text
    assert "| memory | error | 2.0 | Boom: out of / memory |" in text
    assert "- TE: cannot be carried" in text


def test_packed_rows_check_passes_on_the_cpu(tmp_path):
    """The `packing` check's module (packed against padded rows on the device), in this process
    at its CPU size: float32 on both sides, so packed rows give the padded numbers."""
    from bapo_megatron.device_check import packed_rows

    out = tmp_path / "packing.json"
    packed_rows.main(["--device", "cpu", "--sequences", "8", "--length", "48", "--json", str(out)])
    packing = json.loads(out.read_text())
    assert packing["status"] == "passed" and packing["layer_spec"] == "local"
    assert packing["logprob_gap_max"] < 1e-4 and packing["same_bounds"]
    assert packing["loss_relative_gap"] < 1e-5
    assert packing["padding_share"]["packed"] < packing["padding_share"]["padded"]
