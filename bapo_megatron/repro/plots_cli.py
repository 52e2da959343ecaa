"""Draw PNG panels of training runs from their TensorBoard logs, as in the BAPO paper's figures.

    # two runs overlaid (a run's output folder or its tensorboard/ folder)
    bapo-plot-runs runs/bapo runs/grpo --out plots/
    # seeds as groups: the mean with a min-max band (or --band std), TensorBoard-style smoothing
    bapo-plot-runs bapo=runs/bapo-s0,runs/bapo-s1,runs/bapo-s2 \\
        grpo=runs/grpo-s0,runs/grpo-s1,runs/grpo-s2 --out plots/ --smooth 0.6

Panels: training reward, entropy, positive contribution (rho after and before the bound search),
clip fractions (positive tokens above c_high, negative tokens below c_low), gradient norm, response
length of right and wrong answers, c_low and c_high; one PNG each and overview.png with all
(``--panels`` picks some, in its order). Tags a run lacks are skipped with a note. The library
code is :mod:`bapo_megatron.repro.plots`; ``python tools/plot_runs.py`` is the same command.
"""

from __future__ import annotations

import argparse
import sys

from bapo_megatron.repro.plots import PANELS, Panel, parse_run_spec, plot_runs


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="+", metavar="RUN", help="DIR, or LABEL=DIR1,DIR2,... for a group of seeds"
    )
    parser.add_argument("--out", default="plots", help="folder for the PNG files (default plots)")
    parser.add_argument(
        "--band",
        choices=["minmax", "std"],
        default="minmax",
        help="band around a group's mean: min-max over seeds or +-1 std",
    )
    parser.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        help="EMA smoothing weight in [0, 1), as TensorBoard's slider (default 0)",
    )
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch (default 100)")
    parser.add_argument(
        "--rho0",
        type=float,
        default=None,
        help="draw the bound search's target rho0 in the positive-contribution panel",
    )
    parser.add_argument(
        "--panels",
        default=None,
        help="comma-separated panels to draw, in that order (default all: "
        + ",".join(panel.name for panel in PANELS)
        + ")",
    )
    return parser


def chosen_panels(names: str | None) -> tuple[Panel, ...]:
    """The panels named in ``names`` (comma-separated), in that order; None: all of them."""
    if names is None:
        return PANELS
    known = {panel.name: panel for panel in PANELS}
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise ValueError(f"--panels: unknown or no panel {unknown}; known: {sorted(known)}")
    return tuple(known[name] for name in chosen)


def run(argv: list[str] | None = None) -> list[str]:
    """Run the command line ``argv`` (default: the process's arguments) and return the files
    written; exit code 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        groups = [parse_run_spec(spec) for spec in args.runs]
        result = plot_runs(
            groups,
            args.out,
            panels=chosen_panels(args.panels),
            band=args.band,
            smooth=args.smooth,
            dpi=args.dpi,
            rho0=args.rho0,
        )
    except ValueError as err:  # a bad run spec or folder, or bad options
        print(f"{parser.prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for note in result.notes:
        print(f"note: {note}", flush=True)
    for path in result.files:
        print(f"wrote {path}", flush=True)
    return [str(path) for path in result.files]


def main(argv: list[str] | None = None) -> None:
    """The console script's entry point: :func:`run`, with nothing returned (exit code 0)."""
    run(argv)
