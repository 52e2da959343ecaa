"""Does a run's task have BAPO's premise? Figures read from its ``metrics.jsonl``.

The BAPO paper's premise is that failed answers run long, so that the negative-advantage tokens
outweigh the positive ones in the loss and the positive share rho falls below its target rho0
before the bounds adapt. For the first half of a run's rollout steps (after any warm-up) this
module measures: how much longer wrong responses are than right ones, how many wrong ones reach
the length cap, in how many optimizer steps rho before the search is below rho0, and in how many
of those (and of all steps) the search moved the bounds off their starting values.

    python tools/task_figures.py runs/tiny_cpu [--rho0 0.4 --c-low 0.6 --c-high 1.2]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from bapo_megatron.trainer.run_summary import bounds_moved


@dataclass(kw_only=True)
class TaskFigures:
    """The premise's figures over a run's first half (see the module docstring)."""

    rollout_steps: int
    """Rollout steps measured (the first half of those logged)."""
    optimizer_steps: int
    """Optimizer steps those rollout steps trained."""
    length_right: float
    """Mean response tokens of the right responses (end token included)."""
    length_wrong: float
    """Mean response tokens of the wrong responses."""
    wrong_to_right_length: float
    """``length_wrong / length_right``."""
    wrong_at_cap: float
    """Share of the wrong responses that reached the length cap."""
    rho_below_target: float
    """Share of the optimizer steps with a non-zero advantage whose rho before the search is
    below rho0."""
    moved_when_below: float
    """Share of the optimizer steps with rho before the search below rho0 whose bounds moved."""
    moved: float
    """Share of all the optimizer steps whose bounds moved off (c_low, c_high)."""


def read_records(run: str | Path) -> list[dict]:
    """The records of ``run``'s ``metrics.jsonl`` (a run folder or its ``tensorboard/``)."""
    run = Path(run)
    candidates = [run / "metrics.jsonl", run / "tensorboard" / "metrics.jsonl"]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise ValueError(f"{run}: no metrics.jsonl in it or in {run / 'tensorboard'}")
    with path.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


def task_figures(records: list[dict], *, rho0: float, c_low: float, c_high: float) -> TaskFigures:
    """The figures of the first half of the rollout steps in ``records`` (metrics.jsonl lines)."""
    rollouts = [r for r in records if "reward/mean" in r and r.get("rollout_step", 0) > 0]
    if not rollouts:
        raise ValueError("no rollout-step records (reward/mean) to measure")
    half = max(1, len(rollouts) // 2)
    last_step = rollouts[half - 1]["rollout_step"]
    first = rollouts[:half]
    # rollout-step records hold 1-based steps, update records the 0-based step they trained in
    updates = [r for r in records if "bapo/rho_before" in r and r["rollout_step"] < last_step]
    if not updates:
        raise ValueError("no optimizer-step records (bapo/rho_before) to measure")

    def weighted(key: str, share_key: str, right: bool) -> float:
        weights = [r[share_key] if right else 1.0 - r[share_key] for r in first]
        total = sum(weights)
        return sum(r[key] * w for r, w in zip(first, weights)) / total if total else math.nan

    length_right = weighted("response_length/right", "reward/accuracy", True)
    length_wrong = weighted("response_length/wrong", "reward/accuracy", False)
    # a step whose advantages are all zero (every group scored alike) has no rho to speak of
    informative = [
        u for u in updates if u["bapo/positive_contribution"] + u["bapo/negative_contribution"] > 0
    ]
    below = [u for u in informative if u["bapo/rho_before"] < rho0]

    def moved(update: dict) -> bool:
        return bounds_moved(update, c_low, c_high)

    return TaskFigures(
        rollout_steps=half,
        optimizer_steps=len(updates),
        length_right=length_right,
        length_wrong=length_wrong,
        wrong_to_right_length=length_wrong / length_right,
        wrong_at_cap=weighted("rollout/wrong_truncated_fraction", "reward/accuracy", False),
        rho_below_target=len(below) / max(len(informative), 1),
        moved_when_below=sum(map(moved, below)) / len(below) if below else math.nan,
        moved=sum(map(moved, updates)) / len(updates),
    )


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring); exit code 2 on bad input."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder (or its tensorboard/ folder)")
    parser.add_argument("--rho0", type=float, default=0.4, help="target share (default 0.4)")
    parser.add_argument("--c-low", type=float, default=0.6, help="starting c_low (default 0.6)")
    parser.add_argument("--c-high", type=float, default=1.2, help="starting c_high (default 1.2)")
    args = parser.parse_args(argv)
    try:
        figures = task_figures(
            read_records(args.run), rho0=args.rho0, c_low=args.c_low, c_high=args.c_high
        )
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(
        f"first {figures.rollout_steps} rollout steps ({figures.optimizer_steps} optimizer "
        f"steps): wrong responses {figures.length_wrong:.1f} tokens vs right "
        f"{figures.length_right:.1f} ({figures.wrong_to_right_length:.2f}x), "
        f"{figures.wrong_at_cap:.0%} of wrong ones at the cap; rho before the search < "
        f"{args.rho0} in {figures.rho_below_target:.0%} of the optimizer steps, bounds moved in "
        f"{figures.moved_when_below:.0%} of those ({figures.moved:.0%} of all)"
    )
    print(json.dumps(asdict(figures)))
