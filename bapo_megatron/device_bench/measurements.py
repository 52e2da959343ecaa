"""The device benchmarks: memory per component against the layout planner, the loss benchmark,
the packing benchmark, the embedded engine's tokens/s, and the actor's train-step speed against
transformers' model with its model FLOPs utilisation (:mod:`bapo_megatron.device_bench.run`
records them). Each runs in a process of its own, as the device check's checks do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.device_check.start_folder import write_start_folder

if TYPE_CHECKING:
    from bapo_megatron.device_check.processes import Checks

REPO_ROOT = Path(__file__).resolve().parents[2]


MEMORY_MODELS = {
    "qwen3-8b-4l": "Qwen3-8B layer shapes, 4 layers",
    "qwen3-30b-a3b-2l": "Qwen3-30B-A3B layer shapes, 2 layers of 128 experts (top-8), all on "
    "the one device",
}


def memory(checks: Checks, size: str = "qwen3-8b-4l") -> dict:
    argv = [
        "--device",
        checks.args.device,
        "--size",
        size,
        "--variants",
        "paper/step",
        "--steps",
        "2",
        "--distributed-optimizer",
        "--memory",
        "--micro-batch-size",
        "2",
        "--dtype",
        "bfloat16" if checks.gpu else "float32",
    ]
    argv += (
        ["--sequences", "4", "--length", "1024"]
        if checks.gpu
        else ["--cpu-sized", "--sequences", "2", "--length", "32"]
    )
    run = checks.python(
        "bapo_megatron.device_check.actor_steps", *argv, timeout=checks.args.check_timeout
    )
    variant = run["variants"][0]
    if "memory" not in variant:
        return {"status": "not run", "why": "memory is measured with torch.cuda only"}
    return {
        "status": "passed",
        "model": f"{MEMORY_MODELS[size]}, bf16, distributed optimizer, SDPA attention",
        **variant["memory"],
    }


def loss_bench(checks: Checks) -> dict:
    sizes = "1M,8M" if checks.gpu else "64K"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "bench_bapo_loss.py"),
            "--sizes",
            sizes,
            "--repeats",
            "5" if checks.gpu else "2",
            "--device",
            checks.args.device,
        ],
        env=checks.env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=checks.args.check_timeout,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"status": "passed", **report}


def packing_bench(checks: Checks) -> dict:
    """``tools/bench_actor_step.py --packing``: real tokens/s and peak memory of packed rows
    against padded micro-batches of 4 and 1, at L = 4096 on a GPU (CPU: a smoke size)."""
    sizes = (
        [
            "--length",
            "4096",
            "--sequences",
            "64",
            "--hidden",
            "1024",
            "--layers",
            "8",
            "--vocab",
            "32768",
            "--steps",
            "3",
        ]
        if checks.gpu
        else [
            "--length",
            "32",
            "--sequences",
            "8",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--vocab",
            "64",
            "--steps",
            "1",
            "--warmup",
            "0",
        ]
    )
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bench_actor_step.py"), "--packing", *sizes],
        env=checks.env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=checks.args.check_timeout,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return {"status": "passed", **json.loads(proc.stdout.strip().splitlines()[-1])}


def speed_process(checks: Checks, name: str, *argv: str) -> dict:
    """One measurement of :mod:`.model_speed` in a process of its own."""
    return checks.python(
        "bapo_megatron.device_bench.model_speed",
        name,
        "--device",
        checks.args.device,
        *argv,
        timeout=checks.args.check_timeout,
    )


def engine(checks: Checks) -> dict:
    """The embedded engine's generated tokens/s on the device."""
    argv = (
        ["--dtype", "bfloat16"]
        if checks.gpu
        else ["--cpu-sized", "--prompts", "4", "--max-new-tokens", "8"]
    )
    return speed_process(checks, "engine", *argv)


def speed(checks: Checks) -> dict:
    """Actor train-step tokens/s against transformers' model with SDPA, same loss and batch."""
    size = "small"
    start = write_start_folder(
        model_config(size, cpu_sized=not checks.gpu), checks.work / f"start-{size}", seed=0
    )
    dtype = "bfloat16" if checks.gpu else "float32"
    length = 1024 if checks.gpu else 32
    common = [
        "--start",
        str(start),
        "--sequences",
        "16" if checks.gpu else "4",
        "--length",
        str(length),
        "--micro-batch-size",
        "4",
        "--dtype",
        dtype,
        "--steps",
        "4",
    ]
    ours = checks.python(
        "bapo_megatron.device_check.actor_steps",
        "--device",
        checks.args.device,
        "--variants",
        "paper/microbatch,paper/step,grpo/microbatch",
        *common,
        timeout=checks.args.check_timeout,
    )
    theirs = speed_process(checks, "hf-speed", *common)
    fastest = {v["variant"]: min(v["step_seconds"][1:]) for v in ours["variants"]}
    tokens_per_s = ours["tokens_per_step"] / fastest["paper/microbatch"]
    model = ours["model"]
    flops_per_token = (
        6 * dense_parameters(model) + 6 * model["num_layers"] * model["hidden_size"] * length
    )  # attention scores and values, forward + backward
    peak = 989e12 if checks.gpu else None  # H100/H200 SXM dense bf16
    return {
        "status": "passed",
        "actor_tokens_per_s": tokens_per_s,
        "transformers_sdpa_tokens_per_s": theirs["tokens_per_s"],
        "actor_over_transformers": tokens_per_s / theirs["tokens_per_s"],
        "step_seconds": fastest,
        # what BAPO's search (and, at granularity step, its extra forward) adds to a fixed clip
        "paper_microbatch_over_fixed_clip": fastest["paper/microbatch"]
        / fastest["grpo/microbatch"],
        "paper_step_over_fixed_clip": fastest["paper/step"] / fastest["grpo/microbatch"],
        "model_flops_per_token": flops_per_token,
        "actor_mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "mfu_peak_flops": peak,
    }


def dense_parameters(model: dict) -> int:
    """Matrix parameters a token's forward multiplies by (embedding lookup excluded, output
    layer included)."""
    h, f, layers = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    d = model.get("head_dim") or h // model["num_attention_heads"]
    q, kv = model["num_attention_heads"] * d, model["num_query_groups"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    return layers * per_layer + h * model["vocab_size"]
