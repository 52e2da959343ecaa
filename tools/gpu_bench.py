"""The device benchmarks: memory against the layout planner, the loss and packing benchmarks, the
embedded engine's tokens/s and the actor's speed against transformers' model on one GPU, with a
JSON and a markdown report (docs/gpu-check.md). Same as the console script ``bapo-gpu-bench``;
the command line is :mod:`bapo_megatron.device_bench.run`.

    python tools/gpu_bench.py --out runs/gpu-bench
"""

import sys

from bapo_megatron.commands.console import gpu_bench

if __name__ == "__main__":
    sys.exit(gpu_bench())
