"""The trainer's command line: ``python -m bapo_megatron.train --config FILE.yaml
[dotted.key=value ...]`` (also ``bapo-train``), the same under ``torchrun`` on one or many nodes;
``--print-config`` prints the configuration those resolve to, as YAML, and exits.

A user error (a bad setting, file or folder: ``ValueError``, named by what raised it) and a
world that did not form within ``parallel.startup_timeout_s`` end the run with one line,
``error: ...``, and exit code 1; ``--debug`` shows the traceback instead.
What can be checked without building anything is checked first (:func:`preflight`), so a bad
reward name or an unwritable output folder is not found only after the model is built.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from bapo_megatron.config import Config, check_training
from bapo_megatron.config.loading import config_yaml, load_config
from bapo_megatron.config.trackers import check_tracker_packages
from bapo_megatron.disaggregated.engine_rank import run_engine_rank
from bapo_megatron.disaggregated.link import connect_engines
from bapo_megatron.disaggregated.world import join_world
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.startup import WorldNotFormed
from bapo_megatron.files.unpickling_guard import refuse_unpickling_loads
from bapo_megatron.rewards.registry import get_reward
from bapo_megatron.rollout.http import rollout_api_key
from bapo_megatron.trainer.loop import train


def preflight(cfg: Config) -> None:
    """The checks that need neither the process group nor the model: ``ValueError`` naming the
    setting. (The layout against the world and the model is checked by
    :meth:`ParallelContext.initialize` and the task's prompts against the model's context by
    :func:`bapo_megatron.data.task.load_task`, both before the actor is built.)"""
    refuse_unpickling_loads()
    check_training(cfg)
    rollout_api_key(cfg.rollout)  # a named variable that is not set, refused now
    check_tracker_packages(cfg.logging.wandb, cfg.logging.mlflow)
    get_reward(cfg.reward.name)  # unknown names and imports that fail, named
    output = Path(cfg.train.output_dir).absolute()
    existing = next(p for p in (output, *output.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a folder" if not existing.is_dir() else "cannot be written"
        raise ValueError(f"train.output_dir {output}: {existing} {what}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_megatron.train", description="BAPO RL training"
    )
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a user error too"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (the file with the overrides applied) as YAML "
        "and exit",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # per-bucket parameter listings
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(config_yaml(cfg), end="")
            return
        preflight(cfg)
        if cfg.rollout.placement == "disaggregated" and cfg.rollout.engine_ranks:
            run_disaggregated(cfg)
        else:
            context = ParallelContext.initialize(cfg.parallel)
            try:
                train(cfg, context)
            finally:
                context.teardown()
    except (ValueError, WorldNotFormed) as error:
        if args.debug:
            raise
        sys.exit(_one_line(error))


def run_disaggregated(cfg: Config) -> None:
    """This process's part of a disaggregated run: an engine rank serves its engine replica
    until the trainer stops it; a trainer rank trains over the trainer ranks' own world with
    the links to the engines, and stops its engine rank when it ends (normally or not)."""
    role = join_world(cfg)
    if role.is_engine:
        run_engine_rank(cfg, role)
        return
    try:
        context = ParallelContext.initialize(cfg.parallel)
        try:
            engines = connect_engines(cfg, context, role)
            try:
                train(cfg, context, engines)
            finally:
                engines.close()
        finally:
            context.teardown()
    finally:
        role.leave()


def _one_line(error: BaseException) -> str:
    """``error: message`` with the error's notes (where the ranks were), for the console."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    prefix = f"rank {rank}: " if rank is not None and world != "1" else ""
    notes = "".join(f"\n  {note}" for note in getattr(error, "__notes__", ()))
    return f"{prefix}error: {error}{notes}"
