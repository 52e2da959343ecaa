"""The tiny run launched with torchrun over 2 processes (tensor parallel, pipeline parallel), as
the example script does, against the same run in one process: the same rollouts (the engine
gets the same weights through the export) and the same updates up to float rounding."""

from __future__ import annotations

import subprocess

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.gloo_launch import REPO_ROOT  # noqa: E402
from tests.helpers.train_runs import (  # noqa: E402
    FAST,
    read_metrics,
    rollout_records,
    run_in_process,
    subprocess_env,
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs"),
]
SCRIPT = REPO_ROOT / "examples" / "tiny_cpu" / "torchrun_2proc.sh"
STEPS = ["train.steps=3"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, warm_start):
    return run_in_process(tmp_path_factory.mktemp("one"), *warm_start[0], *STEPS)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_two_process_run_matches_one_process(tmp_path, warm_start, single_process, layout):
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
    records = read_metrics(tmp_path)
    ours, reference = rollout_records(records), rollout_records(single_process)
    assert len(ours) == len(reference) == 3
    assert any(r["reward/mean"] > 0 for r in reference)
    for a, b in zip(ours, reference):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["rollout/generated_tokens"] == b["rollout/generated_tokens"]
    updates = [r for r in records if "grad_norm" in r and "reward/mean" not in r]
    expected = [r for r in single_process if "grad_norm" in r and "reward/mean" not in r]
    assert len(updates) == len(expected) == 6
    for a, b in zip(updates, expected):
        for key in ("loss", "grad_norm", "entropy", "bapo/rho_after", "bapo/c_high"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
