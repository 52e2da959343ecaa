"""Write ``docs/config.md``, the configuration reference, from the field docstrings
(:mod:`bapo_megatron.config.reference`); ``--check`` only says whether it is current.

    python tools/config_reference.py [--check]
"""

import argparse
import sys
from pathlib import Path

from bapo_megatron.config.reference import config_reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the page is out of date; write nothing"
    )
    args = parser.parse_args(argv)
    page = config_reference()
    if args.check:
        current = PAGE.is_file() and PAGE.read_text(encoding="utf-8") == page
        print(f"{PAGE}: {'current' if current else 'out of date'}")
        return 0 if current else 1
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
