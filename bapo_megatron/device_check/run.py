"""The GPU self-check (``bapo-gpu-check``): every path of this trainer that one GPU can run,
against float32 CPU references, in a few minutes; with ``--device cpu`` the same checks at tiny
sizes (under a minute), which the test suite runs. Each check runs in a process of its own with
a deadline; a check that fails or overruns is recorded with its error and the others still run.
Writes ``device_check[-LABEL].json`` (every figure) and ``.md`` (a summary) into ``--out``.

    bapo-gpu-check --out $OUT                          # the base pass on one CUDA GPU
    bapo-gpu-check --device cpu --out /tmp/check       # CPU-sized
    bapo-gpu-check --out $OUT --spec te                # the Transformer Engine pass
    bapo-gpu-check --out $OUT --only vllm              # the vLLM pass

The Transformer Engine and vLLM passes need those packages installed
(:mod:`bapo_megatron.device_check.passes`); without them they are refused, with a report that
says why, and exit status 2. What a run did not cover is listed in its report with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bapo_megatron.device_check import passes
from bapo_megatron.device_check.actor_checks import (
    ALL_VARIANTS,
    FP8_RECIPES,
    actor_comparison,
    conversion,
    distributed_optimizer,
    packing,
    same_run_twice,
)
from bapo_megatron.device_check.compare import summary_markdown
from bapo_megatron.device_check.loop_checks import loop, loop_moe, loop_vllm, resume, vllm_engine
from bapo_megatron.device_check.processes import REPO_ROOT, Checks
from bapo_megatron.device_check.report import environment, write_report


def not_on_this_device(why: str) -> dict:
    return {"status": "not run", "why": why}


def run_all(args: argparse.Namespace, work: Path) -> dict:
    checks = Checks(args, work)
    gpu = checks.gpu
    only = passes.wanted_checks(args)

    def want(name: str) -> bool:
        return passes.selected(name, only)

    if want("actor_tiny"):
        # CPU-sized: one variant per preset and granularity is enough to keep the path alive
        variants = ALL_VARIANTS if gpu else "paper/step,reference/microbatch"
        checks.record(
            "actor_tiny",
            actor_comparison,
            checks,
            "tiny",
            variants,
            3 if gpu else 2,
            variants,
            3 if gpu else 2,
            8,
            128 if gpu else 32,
        )
    if want("actor_moe"):
        variants = "paper/step,paper/microbatch" if gpu else "paper/step"
        checks.record(
            "actor_moe",
            actor_comparison,
            checks,
            "tiny-moe",
            variants,
            3 if gpu else 2,
            variants,
            3 if gpu else 2,
            8,
            128 if gpu else 32,
        )
    if want("actor_small"):
        checks.record(
            "actor_small",
            actor_comparison,
            checks,
            "small",
            ALL_VARIANTS,
            3,
            "paper/step",
            1,
            8,
            256 if gpu else 32,
        )
    if want("actor_fp8"):  # the ~0.5B model's matrix dimensions are multiples of 128
        checks.record(
            "actor_fp8",
            actor_comparison,
            checks,
            "small",
            "paper/step",
            2,
            "paper/step",
            1,
            8,
            256,
            FP8_RECIPES,
        )
    tiny_argv = [
        "--device",
        args.device,
        "--size",
        "tiny",
        "--variants",
        "paper/step",
        "--steps",
        "3",
        "--dtype",
        "bfloat16" if gpu else "float32",
    ]
    if want("distributed_optimizer"):
        checks.record("distributed_optimizer", distributed_optimizer, checks, tiny_argv)
    if want("deterministic"):
        size = ["--size", "small"] + ([] if gpu else ["--cpu-sized"])
        checks.record(
            "deterministic",
            same_run_twice,
            checks,
            [*tiny_argv[:2], *size, *tiny_argv[4:], "--length", "256" if gpu else "32"],
        )
    if want("packing"):
        checks.record("packing", packing, checks)
    if want("conversion"):
        checks.record("conversion", conversion, checks)
    if want("loop_tiny"):
        checks.record("loop_tiny", loop, checks, False)
    if want("resume"):
        checks.record("resume", resume, checks)
    if want("loop_small"):
        checks.record("loop_small", loop, checks, True)
    if want("loop_moe"):
        checks.record("loop_moe", loop_moe, checks)
    for name, quantization in (("vllm_engine", None), ("vllm_engine_fp8", "fp8")):
        if want(name):
            if not gpu and name in passes.GPU_ONLY:
                checks.record(name, not_on_this_device, passes.GPU_ONLY[name])
            else:
                checks.record(name, vllm_engine, checks, quantization)
    if want("loop_vllm"):
        checks.record("loop_vllm", loop_vllm, checks)
    return checks.results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--out", required=True, help="folder for device_check.json/.md")
    parser.add_argument(
        "--only",
        help="comma list of check names, `vllm` for the vLLM pass's "
        "(default: all of the base pass, or of the TE pass with --spec te)",
    )
    parser.add_argument(
        "--spec",
        choices=("auto", "te"),
        default="auto",
        help="te: the Transformer Engine pass (refused without TE)",
    )
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    parser.add_argument("--cpu-threads", type=int, default=8, help="of the CPU reference runs")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    parser.add_argument(
        "--reference-pythonpath",
        default=None,
        help="PYTHONPATH of the CPU reference runs (default: this process's); the pass against "
        "a newer megatron-core keeps its CPU references on the pinned one, which the CPU "
        "patches need",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report = {"label": args.label, "environment": environment(args.device, REPO_ROOT)}
    reason = passes.refusal(args, passes.wanted_checks(args))
    if reason is not None:
        print(f"device check refused: {reason}", file=sys.stderr)
        report.update(wall_s=0.0, refused=reason, checks={}, not_run=passes.not_run(args, ()))
        write_report(out, "device_check", args.label, report, summary_markdown(report))
        return 2
    with tempfile.TemporaryDirectory(prefix="device-check-") as work:
        results = run_all(args, Path(work))
    report.update(
        wall_s=round(time.monotonic() - began, 1),
        checks=results,
        not_run=passes.not_run(args, results),
    )
    write_report(out, "device_check", args.label, report, summary_markdown(report))
    print(json.dumps({name: r["status"] for name, r in results.items()}))
    return 0 if all(r["status"] in ("passed", "not run") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
