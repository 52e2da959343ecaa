"""The device benchmarks (``bapo-gpu-bench``): the figures of this trainer on one GPU, beside the
GPU self-check's verdicts (``bapo-gpu-check``, :mod:`bapo_megatron.device_check.run`). With
``--device cpu`` the same measurements at tiny sizes. Each runs in a process of its own with a
deadline; one that fails or overruns is recorded with its error and the others still run.
Writes ``device_bench[-LABEL].json`` (every figure) and ``.md`` (a summary) into ``--out``.

    bapo-gpu-bench --out $OUT                          # every benchmark on one CUDA GPU
    bapo-gpu-bench --device cpu --out /tmp/bench       # CPU-sized
    bapo-gpu-bench --out $OUT --only speed,memory      # some of them
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bapo_megatron.device_bench.measurements import (
    engine,
    loss_bench,
    memory,
    packing_bench,
    speed,
)
from bapo_megatron.device_check.compare import summary_markdown
from bapo_megatron.device_check.processes import REPO_ROOT, Checks
from bapo_megatron.device_check.report import environment, write_report

BENCHMARKS = {
    "memory": (memory,),
    "memory_moe": (memory, "qwen3-30b-a3b-2l"),
    "loss_bench": (loss_bench,),
    "packing_bench": (packing_bench,),
    "engine": (engine,),
    "speed": (speed,),
}
"""Each benchmark: its function of the :class:`Checks` runner, and its further arguments."""

BENCH_HEADLINES = {
    "memory": lambda r: ", ".join(
        f"{k} {v:.2f}" for k, v in r["ratio_measured_over_planned"].items() if v
    ),
    "loss_bench": lambda r: ", ".join(f"{s}: b/a {v['b_over_a']}" for s, v in r["sizes"].items()),
    "engine": lambda r: f"{r['tokens_per_s']:,.0f} tokens/s",
    "speed": lambda r: (
        f"actor/transformers {r['actor_over_transformers']:.2f}x, MFU "
        f"{r['actor_mfu'] or 0:.1%}, BAPO step/fixed clip {r['paper_step_over_fixed_clip']:.2f}x"
    ),
}
"""Per benchmark, the figures of its result worth a glance in the summary."""


def run_all(args: argparse.Namespace, work: Path) -> dict:
    checks = Checks(args, work)
    wanted = args.only.split(",") if args.only else list(BENCHMARKS)
    for name in wanted:
        function, *extra = BENCHMARKS[name]
        checks.record(name, function, checks, *extra)
    return checks.results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--out", required=True, help="folder for device_bench.json/.md")
    parser.add_argument("--only", help=f"comma list of benchmarks, from {list(BENCHMARKS)}")
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per benchmark")
    parser.add_argument("--label", default="", help="a name for this run in the report")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(BENCHMARKS)) if args.only else []
    if unknown:
        parser.error(f"--only: unknown benchmarks {unknown} (choose from {list(BENCHMARKS)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report = {"label": args.label, "environment": environment(args.device, REPO_ROOT)}
    with tempfile.TemporaryDirectory(prefix="device-bench-") as work:
        results = run_all(args, Path(work))
    report.update(wall_s=round(time.monotonic() - began, 1), checks=results, not_run={})
    markdown = summary_markdown(report, "Device benchmarks", BENCH_HEADLINES)
    write_report(out, "device_bench", args.label, report, markdown)
    print(json.dumps({name: r["status"] for name, r in results.items()}))
    return 0 if all(r["status"] in ("passed", "not run") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
