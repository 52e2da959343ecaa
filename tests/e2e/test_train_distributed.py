"""The tiny run launched with torchrun over 2 processes (tensor parallel, pipeline parallel), as
the example script does, against the same run in one process: the same rollouts (the engine
gets the same weights through the export) and the same updates up to float rounding."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.gloo_launch import REPO_ROOT
from tests.helpers.train_runs import (
    FAST,
    assert_same_run,
    read_metrics,
    subprocess_env,
)

pytestmark = [
    pytest.mark.multiprocess,
]
SCRIPT = REPO_ROOT / "examples" / "tiny_cpu" / "torchrun_2proc.sh"
STEPS = ["train.steps=3"]  # as the one-process run (conftest.colocated_three_steps)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_two_process_run_matches_one_process(tmp_path, warm_start, colocated_three_steps, layout):
    # the warm start was saved in one process: a weights checkpoint loads at any layout
    result = subprocess.run(
        ["bash", str(SCRIPT), *FAST, *warm_start[0], *STEPS, f"train.output_dir={tmp_path}"],
        cwd=REPO_ROOT,
        env={**subprocess_env(), "LAYOUT": layout},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert_same_run(read_metrics(tmp_path), colocated_three_steps, rollout_steps=3, updates=6)
