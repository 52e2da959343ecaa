"""Figures of training runs from their TensorBoard logs, panel by panel as in the BAPO paper.

Each panel is one PNG with the runs overlaid, one colour per run: training reward, entropy, the
positive contribution rho (after and before the bound search), the clip fractions (positive
tokens above c_high, negative tokens below c_low), the gradient norm, the response length of
right and wrong answers (BAPO's premise: failures run long), and c_low / c_high. A run
given as a group of log directories (seeds) is drawn as the mean over its seeds with a band
(min-max or +-1 standard deviation) around it, on the steps that every seed logged. The x axis
is the step the trainer logs at: the policy version, i.e. optimizer steps.

Runs that lack a tag are left out of its panel, and a panel that no run has data for is not
drawn; both are reported as notes, never as errors. Figures are built with matplotlib's
object API (no pyplot state), at a fixed size: :data:`PANEL_SIZE` inches at ``dpi``.

    groups = [parse_run_spec("bapo=runs/s0,runs/s1,runs/s2"), parse_run_spec("runs/grpo")]
    result = plot_runs(groups, "plots/")   # plots/reward.png, ..., plots/overview.png
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from bapo_megatron.files.atomic import replaced_atomically
from bapo_megatron.trainer.tracking import read_scalars

PANEL_SIZE = (6.0, 4.0)
"""Width and height of one panel's PNG, in inches (pixels: times ``dpi``)."""
OVERVIEW_COLUMNS = 3
BANDS = ("minmax", "std")
_EVENTS_PREFIX = "events.out.tfevents."
_LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class Panel:
    """One figure: ``series`` are (tag, legend suffix or None) drawn on the same axes."""

    name: str
    """File name stem."""
    title: str
    series: tuple[tuple[str, str | None], ...]
    ylabel: str = ""
    log_y: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Training reward", (("reward/mean", None),), "mean reward"),
    Panel("entropy", "Entropy", (("entropy", None),), "mean token entropy (nats)"),
    Panel(
        "positive_contribution",
        "Positive contribution \u03c1",
        (("bapo/rho_after", "after search"), ("bapo/rho_before", "before search")),
        "share of the loss",
    ),
    Panel(
        "clip_fractions",
        "Clipped tokens",
        (
            ("bapo/clip_frac_positive", "A>0, r > c_high"),
            ("bapo/clip_frac_negative", "A<0, r < c_low"),
        ),
        "fraction of tokens",
    ),
    Panel("grad_norm", "Gradient norm", (("grad_norm", None),), "global norm", log_y=True),
    Panel(
        "response_length",
        "Response length",
        (("response_length/right", "right"), ("response_length/wrong", "wrong")),
        "mean tokens",
    ),
    Panel(
        "clip_bounds",
        "Clip bounds",
        (("bapo/c_low", "c_low"), ("bapo/c_high", "c_high")),
        "ratio bound",
    ),
)


# ------------------------------------------------------------------------ runs


@dataclass(frozen=True)
class RunGroup:
    """One curve per tag: a single run, or the seeds of one setting."""

    label: str
    log_dirs: tuple[Path, ...]


def parse_run_spec(spec: str) -> RunGroup:
    """``DIR`` (labelled with its name) or ``LABEL=DIR1,DIR2,...`` (a group of seeds). A
    directory is a TensorBoard log directory or a run's output folder holding ``tensorboard/``."""
    label, sep, dirs = spec.partition("=")
    if not sep:
        label, dirs = "", spec
    paths = tuple(Path(d) for d in dirs.split(",") if d.strip())
    if not paths or (sep and not label.strip()):
        raise ValueError(f"run {spec!r}: expected DIR or LABEL=DIR1,DIR2,...")
    if not label:
        label = paths[0].name if paths[0].name != "tensorboard" else paths[0].parent.name
    return RunGroup(label.strip(), tuple(resolve_log_dir(p) for p in paths))


def resolve_log_dir(path: str | Path) -> Path:
    """``path`` if it holds event files, else its ``tensorboard/`` folder; ``ValueError`` if
    neither does."""
    path = Path(path)
    for candidate in (path, path / "tensorboard"):
        if candidate.is_dir() and any(candidate.glob(_EVENTS_PREFIX + "*")):
            return candidate
    raise ValueError(f"{path}: no TensorBoard event files in it or in {path / 'tensorboard'}")


# ------------------------------------------------------------------------ aggregation


@dataclass
class Curve:
    """A group's curve of one tag: mean over seeds and the band, on the common steps."""

    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: int


def smooth_ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    if weight <= 0:
        return values
    out, last, norm = np.empty_like(values, dtype=np.float64), 0.0, 0.0
    for i, value in enumerate(values):
        last = weight * last + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out[i] = last / norm
    return out


def aggregate(
    series: Sequence[Sequence[tuple[int, float]]], *, band: str = "minmax", smooth: float = 0.0
) -> Curve | None:
    """Mean and band over seeds' ``[(step, value)]`` lists, on the steps all of them have
    (None if they share none). Each seed is smoothed first (``smooth``: EMA weight in [0, 1))."""
    if band not in BANDS:
        raise ValueError(f"band must be one of {list(BANDS)}, got {band!r}")
    if not 0 <= smooth < 1:
        raise ValueError(f"smooth must lie in [0, 1), got {smooth!r}")
    if not series:
        return None
    steps = sorted(set.intersection(*({s for s, _ in seed} for seed in series)))
    if not steps:
        return None
    rows = []
    for seed in series:
        by_step = dict(seed)
        all_steps = sorted(by_step)
        smoothed = dict(
            zip(
                all_steps,
                smooth_ema(np.array([by_step[s] for s in all_steps], dtype=np.float64), smooth),
            )
        )
        rows.append([smoothed[s] for s in steps])
    values = np.array(rows)  # [seeds, steps]
    mean = values.mean(axis=0)
    if band == "minmax":
        low, high = values.min(axis=0), values.max(axis=0)
    else:
        spread = values.std(axis=0)
        low, high = mean - spread, mean + spread
    return Curve(np.array(steps), mean, low, high, len(series))


# ------------------------------------------------------------------------ drawing


@dataclass
class PlotResult:
    files: list[Path] = field(default_factory=list)
    """PNG files written: one per panel with data, then ``overview.png``."""
    notes: list[str] = field(default_factory=list)
    """Tags missing from runs, panels skipped."""


def _draw_panel(
    axes, panel: Panel, curves: list[tuple[int, str, str | None, int, Curve]], rho0: float | None
) -> None:
    colors = [f"C{i}" for i in range(10)]
    if rho0 is not None and panel.name == "positive_contribution":
        axes.axhline(
            rho0, color="gray", linestyle=":", linewidth=1.0, label=f"\u03c1\u2080 = {rho0:g}"
        )
    for group_index, label, suffix, style, curve in curves:
        color = colors[group_index % len(colors)]
        name = label if suffix is None else f"{label}: {suffix}"
        if curve.seeds > 1:
            name += f" (mean of {curve.seeds})"
            axes.fill_between(
                curve.steps, curve.low, curve.high, color=color, alpha=0.2, linewidth=0
            )
        axes.plot(
            curve.steps,
            curve.mean,
            color=color,
            linestyle=_LINESTYLES[style % 4],
            linewidth=1.5,
            label=name,
            marker="o" if len(curve.steps) == 1 else None,
        )
    axes.set_title(panel.title)
    axes.set_xlabel("step (policy version)")
    axes.set_ylabel(panel.ylabel)
    if panel.log_y and all((c.low > 0).all() for *_, c in curves):
        axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")


def _save(figure, path: Path) -> None:
    with replaced_atomically(path) as tmp:
        figure.savefig(tmp, format="png")


def plot_runs(
    groups: Sequence[RunGroup],
    out_dir: str | Path,
    *,
    panels: Sequence[Panel] = PANELS,
    band: str = "minmax",
    smooth: float = 0.0,
    dpi: int = 100,
    rho0: float | None = None,
) -> PlotResult:
    """Read every group's logs and write ``<panel.name>.png`` for each panel with data, and
    ``overview.png`` with all of them, into ``out_dir``. ``rho0``: the target of the bound
    search, drawn as a reference line in the positive-contribution panel."""
    # Requirements pins (tested with): matplotlib==3.11.2 and its dependencies contourpy==1.3.3,
    # cycler==0.12.1, fonttools==4.68.0, kiwisolver==1.5.1, pyparsing==3.3.2,
    # python-dateutil==2.9.0.post0, six==1.17.0 (numpy, packaging and pillow are pinned already).

    if not groups:
        raise ValueError("plot_runs: no runs given")
    labels = [g.label for g in groups]
    if len(set(labels)) != len(labels):
        raise ValueError(f"plot_runs: run labels must differ, got {labels}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = PlotResult()
    scalars = {g.label: [read_scalars(d) for d in g.log_dirs] for g in groups}
    drawn: list[tuple[Panel, list]] = []
    for panel in panels:
        curves = []
        for group_index, group in enumerate(groups):
            for style, (tag, suffix) in enumerate(panel.series):
                seeds = []
                for directory, logged in zip(group.log_dirs, scalars[group.label]):
                    if logged.get(tag):
                        seeds.append(logged[tag])
                    else:
                        result.notes.append(f"run {group.label!r}: {directory} has no {tag!r}")
                curve = aggregate(seeds, band=band, smooth=smooth)
                if seeds and curve is None:
                    result.notes.append(f"run {group.label!r}: its seeds share no step of {tag!r}")
                if curve is not None:
                    curves.append((group_index, group.label, suffix, style, curve))
        if not curves:
            result.notes.append(
                f"panel {panel.name!r}: no run has "
                f"{' or '.join(repr(t) for t, _ in panel.series)}; not drawn"
            )
            continue
        figure = Figure(figsize=PANEL_SIZE, dpi=dpi, layout="constrained")
        _draw_panel(figure.add_subplot(), panel, curves, rho0)
        path = out_dir / f"{panel.name}.png"
        _save(figure, path)
        result.files.append(path)
        drawn.append((panel, curves))
    if drawn:
        columns = min(OVERVIEW_COLUMNS, len(drawn))
        rows = math.ceil(len(drawn) / columns)
        figure = Figure(
            figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), dpi=dpi, layout="constrained"
        )
        for index, (panel, curves) in enumerate(drawn):
            _draw_panel(figure.add_subplot(rows, columns, index + 1), panel, curves, rho0)
        path = out_dir / "overview.png"
        _save(figure, path)
        result.files.append(path)
    return result
