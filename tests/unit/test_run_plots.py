"""Run plots (bapo_megatron.repro.plots, tools/plot_runs.py) from event files written by the
trainer's own logger: a group of two seeds and a single run that lacks some tags. Every panel
must come out as a PNG of the expected size, missing tags must be notes, and a group's curve must
be the mean of its seeds with the chosen band."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bapo_megatron.files.atomic import new_file_mode
from bapo_megatron.repro import plots_cli
from bapo_megatron.repro.plots import (
    OVERVIEW_COLUMNS,
    PANEL_SIZE,
    PANELS,
    aggregate,
    parse_run_spec,
    plot_runs,
    smooth_ema,
)
from bapo_megatron.trainer.tracking import MetricsLogger

STEPS = 6
ALL_TAGS = [tag for panel in PANELS for tag, _ in panel.series]


def _write_run(folder: Path, seed: int, *, skip: tuple[str, ...] = (), steps: int = STEPS) -> None:
    """Event files (under ``folder/tensorboard``, as the trainer writes them) with every panel's
    tags except ``skip``, on steps 0..steps-1."""
    rng = np.random.default_rng(seed)
    with MetricsLogger(folder / "tensorboard", console=False) as logger:
        for step in range(steps):
            values = {tag: float(rng.uniform(0.1, 1.0)) for tag in ALL_TAGS if tag not in skip}
            logger.log(step, values)


def _expected_pixels(columns: int = 1, rows: int = 1, dpi: int = 100) -> tuple[int, int]:
    return round(PANEL_SIZE[0] * columns * dpi), round(PANEL_SIZE[1] * rows * dpi)


def _tool_main(argv: list[str]) -> list[str]:
    """The command line (tools/plot_runs.py, bapo-plot-runs) in this process."""
    return plots_cli.run(argv)


def test_group_and_single_run_give_every_panel(tmp_path, capsys):
    _write_run(tmp_path / "bapo-s0", seed=0)
    _write_run(tmp_path / "bapo-s1", seed=1)
    _write_run(tmp_path / "grpo", seed=2, skip=("bapo/rho_before", "bapo/clip_frac_negative"))
    out = tmp_path / "plots"
    written = _tool_main(
        [
            f"bapo={tmp_path / 'bapo-s0'},{tmp_path / 'bapo-s1'}",
            str(tmp_path / "grpo" / "tensorboard"),
            "--out",
            str(out),
            "--rho0",
            "0.4",
            "--smooth",
            "0.5",
        ]
    )
    names = [Path(p).name for p in written]
    assert names == [f"{panel.name}.png" for panel in PANELS] + ["overview.png"]
    mode = new_file_mode()
    for path in map(Path, written):
        assert path.is_file() and path.stat().st_size > 0
        assert path.stat().st_mode & 0o777 == mode  # not mkstemp's private 0o600
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            rows = math.ceil(len(PANELS) / OVERVIEW_COLUMNS)
            want = (
                _expected_pixels(OVERVIEW_COLUMNS, rows)
                if path.name == "overview.png"
                else _expected_pixels()
            )
            assert image.format == "PNG" and image.size == want, path.name
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # nothing left aside
    printed = capsys.readouterr().out
    assert "note: run 'grpo'" in printed and "'bapo/rho_before'" in printed
    assert "'bapo/clip_frac_negative'" in printed


def test_missing_panels_are_notes_not_errors(tmp_path):
    _write_run(tmp_path / "run", seed=0, skip=tuple(t for t in ALL_TAGS if t != "reward/mean"))
    result = plot_runs([parse_run_spec(str(tmp_path / "run"))], tmp_path / "plots", dpi=50)
    assert [p.name for p in result.files] == ["reward.png", "overview.png"]
    with Image.open(result.files[0]) as image:
        assert image.size == _expected_pixels(dpi=50)
    with Image.open(result.files[1]) as image:  # one panel: a 1 x 1 overview
        assert image.size == _expected_pixels(dpi=50)
    skipped = [n for n in result.notes if n.startswith("panel ")]
    assert len(skipped) == len(PANELS) - 1 and all("not drawn" in n for n in skipped)


def test_bad_run_specs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no TensorBoard event files"):
        parse_run_spec(str(tmp_path))
    with pytest.raises(ValueError, match="LABEL=DIR1"):
        parse_run_spec("=a,b")
    _write_run(tmp_path / "a", seed=0, steps=1)
    with pytest.raises(ValueError, match="labels must differ"):
        plot_runs([parse_run_spec(f"x={tmp_path / 'a'}")] * 2, tmp_path / "plots")
    assert parse_run_spec(str(tmp_path / "a")).label == "a"
    assert parse_run_spec(str(tmp_path / "a" / "tensorboard")).label == "a"


def test_group_curve_is_the_mean_over_common_steps_with_its_band():
    seeds = [[(0, 1.0), (1, 2.0), (2, 4.0)], [(1, 4.0), (2, 0.0), (3, 9.0)]]
    curve = aggregate(seeds, band="minmax")
    assert curve.steps.tolist() == [1, 2] and curve.seeds == 2
    assert curve.mean.tolist() == [3.0, 2.0]
    assert curve.low.tolist() == [2.0, 0.0] and curve.high.tolist() == [4.0, 4.0]
    std = aggregate(seeds, band="std")
    # +-1 standard deviation of two values: the same band
    assert np.allclose(std.low, [2.0, 0.0]) and np.allclose(std.high, [4.0, 4.0])
    assert aggregate([[(0, 1.0)], [(1, 1.0)]]) is None
    # EMA smoothing as TensorBoard's: debiased, so a constant stays constant
    assert np.allclose(smooth_ema(np.full(5, 3.0), 0.9), 3.0)
    assert np.allclose(smooth_ema(np.array([0.0, 1.0]), 0.5), [0.0, 0.5 / 0.75])
