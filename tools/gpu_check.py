"""The GPU self-check: every path of this trainer that one CUDA GPU can run, against float32 CPU
references, with a JSON and a markdown report (docs/gpu-check.md). Same as the console script
``bapo-gpu-check``; the command line is :mod:`bapo_megatron.device_check.run`.

    python tools/gpu_check.py --out runs/gpu-check
"""

import sys

from bapo_megatron.commands.console import gpu_check

if __name__ == "__main__":
    sys.exit(gpu_check())
