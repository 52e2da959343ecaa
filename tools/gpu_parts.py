"""The GPU machine's side of carried package sets (docs/gpu-checks.md): copy a carried part out
of the checkout, and join a set's parts once all are there. Standard library only.

    PYTHONPATH=. python3 tools/gpu_parts.py stash .carry/te-1          # to /root/parts/te/
    PYTHONPATH=. python3 tools/gpu_parts.py join te --out /root/carry/te
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bapo_megatron.device_check.carry import CarryError, join_parts, stash_part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=Path, default=Path("/root/parts"), help="stash root")
    commands = parser.add_subparsers(dest="command", required=True)
    stash = commands.add_parser("stash", help="copy one carried part folder's part out")
    stash.add_argument("folder", type=Path)
    join = commands.add_parser("join", help="check and join a set's parts, unpack its files")
    join.add_argument("set")
    join.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "stash":
            print(stash_part(args.folder, args.parts))
        else:
            for path in join_parts(args.parts / args.set, args.out):
                print(path)
    except CarryError as error:
        print(f"gpu_parts: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
