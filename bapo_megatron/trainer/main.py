"""The trainer's command line: ``python -m bapo_megatron.train --config FILE.yaml
[dotted.key=value ...]`` (also ``bapo-train``), the same under ``torchrun`` on one or many nodes."""

from __future__ import annotations

import argparse
import logging
import sys

from bapo_megatron.config.loading import load_config
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.trainer.loop import train


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_megatron.train", description="BAPO RL training"
    )
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-bucket parameter listings
    try:
        cfg = load_config(args.config, args.overrides)
        cfg.check_training()
    except ValueError as err:
        sys.exit(f"config error: {err}")
    context = ParallelContext.initialize(cfg.parallel)
    try:
        train(cfg, context)
    finally:
        context.teardown()
