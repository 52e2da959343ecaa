"""Fetch a package set for the lent GPU machine and split it into parts to carry there
(docs/gpu-checks.md; the sets: :mod:`bapo_megatron.device_check.carry_sets`). Run on a machine
with pip, from the checkout:

    PYTHONPATH=. python3 tools/gpu_carry.py base    # .whl/: megatron-core, math-verify (3 MiB)
    PYTHONPATH=. python3 tools/gpu_carry.py te      # .carry/te-1 .. te-4 (~175 MiB)
    PYTHONPATH=. python3 tools/gpu_carry.py vllm    # .carry/vllm-1 .. vllm-4 (~185 MiB)
    PYTHONPATH=. python3 tools/gpu_carry.py te --built transformer_engine_torch-...whl

and prints the GPU session's commands, each with the paths it carries (``.carry/`` and ``.whl/``
are ignored by git, so they travel only when named).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bapo_megatron.device_check.carry_sets import SETS, gpu_commands, prepare

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("set", choices=SETS)
    parser.add_argument("--out", type=Path, default=ROOT / ".carry", help="part folders' root")
    parser.add_argument("--built", type=Path, help="te: a built transformer_engine_torch wheel")
    args = parser.parse_args(argv)
    folders = prepare(args.set, args.out.resolve(), built=args.built)
    for folder in folders:
        size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
        print(f"{folder.relative_to(ROOT)}: {size:.1f} MiB")
    if args.set != "base":
        print("GPU session, one command per run, back to back on one warm machine:")
        for command, carry in gpu_commands(args.set, folders, ROOT):
            print(json.dumps({"command": command, "carry": carry}))


if __name__ == "__main__":
    main()
