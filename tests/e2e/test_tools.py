"""The benchmark script runs and reports what it promises (no timing assertions)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers import preloaded_processes

ROOT = Path(__file__).resolve().parents[2]
# The scripts import the package (and bench_bapo_loss.py tests/) from this checkout, which the
# editable install may not point at.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}


def benchmark_report(tool: str, *args: str) -> dict:
    """Run ``tools/<tool>`` with ``args``; the JSON object its last line prints."""
    out = preloaded_processes.run(
        [sys.executable, str(ROOT / "tools" / tool), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_loss_benchmark_smoke():
    report = benchmark_report(
        "bench_bapo_loss.py", "--sizes", "64K", "--repeats", "1", "--threads", "1"
    )
    res = report["sizes"]["64K"]
    assert res["steps"] >= 20  # the data makes the search walk far, as the targets require
    assert res["reductions"]["b"] == 1 and res["reductions"]["c"] == res["steps"] + 1
    assert res["targets"]["bounds_agree_b_c"] is True
    assert {"b_over_a", "c_over_b"} <= set(res)


def test_actor_step_benchmark_smoke():
    report = benchmark_report(
        "bench_actor_step.py",
        "--layouts",
        "tp1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--sequences",
        "2",
        "--micro-batch-size",
        "1",  # two micro-batches: the stale `paper` step pays the extra forward pass
        "--length",
        "16",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--vocab",
        "128",
    )
    tp1 = report["layouts"]["tp1"]
    assert report["benchmark"] == "actor_step" and tp1["processes"] == 1
    assert tp1["step_ms"] > 0 and tp1["tokens_per_s"] > 0
    assert 0 < tp1["search_share"] < 1 and tp1["step_vs_fixed_clip"] > 0
    assert set(tp1["cases"]) == {"paper", "paper_ratios_known", "reference", "grpo"}
    assert tp1["cases"]["grpo"]["vs_fixed_clip"] == 1.0


def test_actor_step_packing_benchmark_smoke():
    report = benchmark_report(
        "bench_actor_step.py",
        *("--packing", "--steps", "1", "--warmup", "0", "--sequences", "8", "--length", "32"),
        *("--layers", "1", "--hidden", "32", "--vocab", "64"),
    )
    assert report["benchmark"] == "actor_step_packing"
    cases = report["cases"]
    assert set(cases) == {"padded_mb4", "padded_mb1", "packed"}
    assert set(report["packed_over_padded"]) == {"padded_mb4", "padded_mb1"}
    # the long tail leaves padded rows mostly padding; packed rows pad each sequence to 1 token
    assert cases["padded_mb4"]["padding_share"] > 0.3
    assert cases["packed"]["padding_share"] == 0.0
    assert cases["packed"]["micro_batches"] < cases["padded_mb1"]["micro_batches"] == 8
    assert report["padding_share"]["packed"] == 0.0


def test_weights_benchmark_smoke(tmp_path):
    report = benchmark_report(
        "bench_weights.py",
        "--dtype",
        "float32",
        "--hidden",
        "64",
        "--layers",
        "4",
        "--ffn",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "128",
        "--repeats",
        "1",
        "--bucket-mib",
        "0.05",
        "--workdir",
        str(tmp_path),
        "--timeout",
        "240",
    )
    assert report["benchmark"] == "weights"
    # The bytes of every rank's shards (what the copy and the export move) at TP2/PP2: embedding
    # and untied output 2 x 128 x 64, per layer q,k,v,o + 3 MLP matrices, and the norms (per layer
    # 2 x 64, final 64), which every TP rank holds whole, hence twice.
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert report["parameters"] == 2 * 128 * 64 + 4 * layer + 2 * (4 * 2 * 64 + 64)
    assert report["model_bytes"] == 4 * report["parameters"]
    for key in (
        "copy_gbps",
        "export_gbps",
        "export_kept_buffer_gbps",
        "hf_to_megatron_s",
        "read_write_s",
    ):
        assert report[key] > 0, key
    assert abs(report["export_over_copy"] - report["export_gbps"] / report["copy_gbps"]) < 0.01


def test_rollout_benchmark_smoke():
    import importlib.util

    # one thread: the tiny model gains nothing from two, which only wait on each other
    report = benchmark_report("bench_rollout.py", "--quick", "--threads", "1")
    assert report["benchmark"] == "rollout"
    cfg, emb = report["config"], report["embedded"]
    # no stop tokens: every sample runs to max_new_tokens (4 prompts x n=2 x 8 tokens)
    assert cfg["prompts"] * cfg["n"] * cfg["max_new_tokens"] == 64
    assert emb["generated_tokens"] == report["generation"]["expected_tokens"] == 64
    assert emb["finish_reasons"] == {"length": 8} and emb["samples"] == 8
    assert report["embedded_tokens_per_s"] > 0
    assert abs(emb["tokens_per_s"] - 64 / emb["generate_s"]) <= 0.01 * emb["tokens_per_s"]
    # the quick update model: qwen2, tied, hidden 64, 2 layers, 2 heads of 32 in 1 group, MLP
    # 128, vocab 256: embedding + per layer q,k,v (with biases), o, MLP, 2 norms + final norm
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    update = report["weight_update"]
    assert update["parameters"] == update["megatron_parameters"] == 256 * 64 + 2 * layer + 64
    assert update["model_bytes"] == 4 * update["parameters"]
    assert update["export_plus_update_measured"] is True  # export in this process (megatron-core)
    assert update["embedded_weights_match_export"] is True  # the engine holds the exported weights
    assert report["export_s"] > 0 and report["weight_update_s"]["embedded"] > 0
    assert report["export_plus_update_s"]["embedded"] > 0
    if importlib.util.find_spec("vllm") is None:
        assert report["vllm"] is None and report["vllm_tokens_per_s"] is None
        assert report["vllm_over_embedded"] is None and "not importable" in report["vllm_reason"]
        assert set(report["weight_update_s"]) == {"embedded"}
    else:
        assert report["vllm"]["generated_tokens"] == 64 and report["vllm_tokens_per_s"] > 0
        assert report["weight_update_s"]["vllm"] > 0


def test_convert_checkpoint_names_the_damaged_file_in_one_line(tmp_path):
    """A truncated ``.distcp`` shard: torch's reader says only ``CheckpointException ...
    EOFError``; the tool must exit non-zero with one line naming the file, no traceback."""
    from bapo_megatron.weights import convert_cli
    from tests.helpers import hf_models

    hf_models.save_hf_folder(tmp_path / "hf", "qwen2-tied", seed=0)
    convert_cli.main(
        ["hf-to-megatron", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--no-progress"]
    )
    shard = tmp_path / "ckpt" / "__0_1.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    done = preloaded_processes.run(
        [
            sys.executable,
            str(ROOT / "tools" / "convert_checkpoint.py"),
            "megatron-to-hf",
            str(tmp_path / "ckpt"),
            str(tmp_path / "out"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("convert_checkpoint.py: error: Megatron checkpoint ") and (
        f"{shard} is truncated: 1000 bytes" in last
    ), done.stderr
    assert not (tmp_path / "out").exists()


def test_async_benchmark_smoke():
    report = benchmark_report("bench_async.py", "--quick", "--modes", "colocated,eta1")
    assert report["benchmark"] == "async" and set(report["modes"]) == {"colocated", "eta1"}
    cfg, colocated, eta1 = report["config"], report["modes"]["colocated"], report["modes"]["eta1"]
    assert (colocated["processes"], colocated["threads"]) == (1, 2)  # equal cores: 2 each
    assert (eta1["processes"], eta1["threads"]) == (2, 1)
    for figures in (colocated, eta1):
        assert figures["steady_steps"] == cfg["steps"] - cfg["skip"]
        rate = 60 * figures["steady_steps"] / figures["steady_wall_s"]
        assert abs(figures["steps_per_minute"] - rate) <= 1e-6 * rate
        for share in ("trainer_idle_share", "engine_idle_share", "weight_update_share"):
            assert 0 <= figures[share] <= 1, share
        assert figures["step_over_bound_max"] >= figures["step_over_bound_median"] > 0
    assert colocated["staleness_max"] == 0  # synchronous: every token from the current policy
    assert 0 <= eta1["staleness_max"] <= 1 and eta1["dropped_groups"] == 0
    assert eta1["queued_items_mean"] > 1  # the engine was given the next step's item ahead
    assert 0 <= eta1["engine_weight_load_share"] <= 1
    targets = report["targets"]
    assert targets["colocated"]["steps_per_minute_vs_colocated"] == 1.0
    assert "async_at_least_1_5x" not in targets["colocated"]
    assert isinstance(targets["eta1"]["async_at_least_1_5x"], bool)
    assert report["colocated_rollout_over_train"] > 0


def test_moe_step_benchmark_smoke():
    report = benchmark_report(
        "bench_moe_step.py",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--sequences",
        "2",
        "--length",
        "16",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--experts",
        "4",
        "--vocab",
        "128",
    )
    assert report["benchmark"] == "moe_step"
    for name in ("ep1", "ep2"):
        layout = report["layouts"][name]
        assert layout["processes"] == 2 and layout["step_ms"] > 0 and layout["replay_ratio"] > 0
    assert report["ep2_vs_ep1"] > 0
