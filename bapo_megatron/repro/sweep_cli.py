"""Run the staleness sweep on the CPU and write its markdown report.

    # the full sweep: 5 methods x 8 staleness settings x 3 seeds, 2 processes at a time
    bapo-sweep --out runs/sweep
    # the CI configuration: 2 methods x 2 staleness settings x 1 seed x 4 rollout steps
    bapo-sweep --minimal --out /tmp/sweep
    # a part of it (rerunning the same command later adds the rest; finished runs are kept)
    bapo-sweep --out runs/sweep --staleness reuse1 reuse4 --seeds 0

Methods: grpo [0.8, 1.2], clip-higher [0.8, 1.28], fixed-0.6 [0.6, 1.2], bapo-paper,
bapo-reference. Staleness: reuse<k> (k optimizer steps per rollout batch), lag<k> (train on the
batch generated k rollout steps earlier), partial<b> (partial rollout, b tokens per round),
async<k> (the asynchronous pipeline at algorithm.max_staleness=k: a trainer and an engine
process under torchrun, one optimizer step per rollout step, the engine k steps ahead).
Output: ``<out>/report.md``, ``<out>/plots/<staleness>/``,
``<out>/runs/<staleness>/<method>/seed<k>``. The library code is :mod:`bapo_megatron.repro.sweep`;
``python tools/sweep.py`` is the same command.
"""

from __future__ import annotations

import argparse
import sys

from bapo_megatron.repro.sweep import SweepSettings, run_sweep


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/sweep", help="output folder (default runs/sweep)")
    parser.add_argument(
        "--minimal",
        action="store_true",
        help="the tiny CI configuration (2 methods x 2 staleness settings x 1 seed x 4 steps)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="training processes at a time, an async run counting 2 (default 2)",
    )
    parser.add_argument(
        "--task", default=None, help="synthetic task: count_up_and_stop (default), count_to"
    )
    parser.add_argument("--methods", nargs="+", default=None, help="subset of the methods")
    parser.add_argument(
        "--staleness", nargs="+", default=None, help="subset of the staleness settings"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="train.seed of each run")
    parser.add_argument("--steps", type=int, default=None, help="rollout steps that train, per run")
    return parser


def run(argv: list[str] | None = None) -> str:
    """Run the command line ``argv`` (default: the process's arguments) and return the report's
    path; exit code 2 on bad settings."""
    parser = build_parser()
    args = parser.parse_args(argv)
    names = ("jobs", "task", "methods", "staleness", "seeds", "steps")
    changes = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        settings = SweepSettings.minimal(**changes) if args.minimal else SweepSettings(**changes)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return str(run_sweep(settings, args.out, progress=lambda line: print(line, flush=True)))


def main(argv: list[str] | None = None) -> None:
    """The console script's entry point: :func:`run`, with nothing returned (exit code 0)."""
    run(argv)
