"""Candidate grids and walk order of the two schedules."""

from __future__ import annotations

import pytest

from bapo_megatron.algo import SearchPlan
from bapo_megatron.config import ClipSearchConfig


def test_paper_grid_reaches_its_max_without_float_drift():
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
    assert len(plan.c_low_values) == 16 and plan.c_low_values[-1] == 0.9
    assert len(plan.c_high_values) == 37 and plan.c_high_values[-1] == 3.0
    assert plan.c_low_values[:3] == (0.6, 0.62, 0.64)
    assert plan.max_steps == 36 + 15


def test_paper_path_moves_c_high_first_then_c_low():
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper"))
    assert plan.path[0] == (0, 0)
    assert plan.path[36] == (0, 36)
    assert plan.path[37] == (1, 36)
    assert plan.path[-1] == (15, 36)


def test_reference_path_moves_c_low_first_and_clamps_the_last_step():
    cfg = ClipSearchConfig.from_preset("reference", c_high_step=0.3)
    plan = SearchPlan.from_config(cfg)
    assert plan.c_low_values == (0.6, 0.65, 0.7, 0.75, 0.8)
    assert plan.c_high_values == (1.2, 1.5, 1.8, 2.0)
    assert plan.path[:5] == ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0))
    assert plan.path[5:] == ((4, 1), (4, 2), (4, 3))


def test_paper_schedule_moves_nothing_when_c_low_cannot_move():
    # Algorithm 1's loop condition is on c_low alone: with an empty c_low range c_high stays put.
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset("paper", c_low_max=0.6))
    assert plan.is_fixed


@pytest.mark.parametrize("preset,bounds", [("grpo", (0.8, 1.2)), ("clip-higher", (0.8, 1.28))])
def test_fixed_presets_are_empty_searches(preset, bounds):
    plan = SearchPlan.from_config(ClipSearchConfig.from_preset(preset))
    assert plan.is_fixed
    assert (plan.c_low_values[0], plan.c_high_values[0]) == bounds
