"""The tiny run launched with torchrun over 2 processes (tensor parallel, pipeline parallel), as
the example script does, against the same run in one process: the same rollouts (the engine
gets the same weights through the export) and the same updates up to float rounding. And the
tensor-parallel run started by ``examples/launch/torchrun_multinode.sh`` with one rank killed
after a checkpoint: torchrun restarts both ranks in place, they resume, and the run ends with
the uninterrupted run's metrics. And the tensor-parallel run with the shard-to-shard weight sync:
bitwise the broadcast run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.fault_rewards import KILL_AFTER, KILL_MARK, KILL_WORKER
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
MULTINODE_SCRIPT = REPO_ROOT / "examples" / "launch" / "torchrun_multinode.sh"
STEPS = ["train.steps=3"]  # as the one-process run (conftest.colocated_three_steps)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, warm_start):
    """The run of the example script at a layout (``tp2``, ``pp2``), once per module: its
    metric records."""
    records = {}

    def run(layout: str) -> list[dict]:
        if layout not in records:
            output = tmp_path_factory.mktemp(layout)
            # the warm start was saved in one process: a weights checkpoint loads at any layout
            result = subprocess.run(
                ["bash", str(SCRIPT), *FAST, *warm_start[0], *STEPS, f"train.output_dir={output}"],
                cwd=REPO_ROOT,
                env={**subprocess_env(), "LAYOUT": layout},
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
            records[layout] = read_metrics(output)
        return records[layout]

    return run


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_two_process_run_matches_one_process(two_process_run, colocated_three_steps, layout):
    records = two_process_run(layout)
    assert_same_run(records, colocated_three_steps, rollout_steps=3, updates=6)


def test_the_shard_to_shard_sync_gives_the_broadcast_runs_results(
    tmp_path, warm_start, two_process_run
):
    """The TP2 run with ``rollout.weight_transport=shard-to-shard``: rank 1 sends its shards
    straight into rank 0's embedded engine, which then holds the weights the broadcast path
    gives it, so the run is bitwise the broadcast run."""
    output = tmp_path / "run"
    result = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            *FAST,
            *warm_start[0],
            *STEPS,
            "rollout.weight_transport=shard-to-shard",
            f"train.output_dir={output}",
        ],
        cwd=REPO_ROOT,
        env={**subprocess_env(), "LAYOUT": "tp2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert_same_run(
        read_metrics(output), two_process_run("tp2"), rollout_steps=3, updates=6, bitwise=True
    )


def test_a_killed_rank_restarts_in_place_and_the_run_ends_as_uninterrupted(
    tmp_path, warm_start, two_process_run
):
    """Rank 0 (the one serving its attempt's store and holding the output folder's lock) is
    killed in the first reward phase after checkpoint 1 exists (:func:`kills_a_rank_once`);
    with ``MAX_RESTARTS=1`` torchrun starts both ranks again, each says which checkpoint it
    resumed from, and the metrics are bitwise those of the uninterrupted run."""
    output, mark = tmp_path / "run", tmp_path / "killed"
    overrides = [
        *FAST,
        *warm_start[0],
        *STEPS,
        "parallel.tensor_model_parallel_size=2",
        "checkpoint.interval=1",
        "reward.name=tests.helpers.fault_rewards:kills_a_rank_once",
        f"train.output_dir={output}",
    ]
    env = {
        "NNODES": "1",
        "NODE_RANK": "0",
        "GPUS_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",  # the rendezvous store on a port the system picks
        "MAX_RESTARTS": "1",
        "OMP_NUM_THREADS": "1",
        KILL_WORKER: "0 0",
        KILL_AFTER: str(output / "checkpoints" / "step_00000001"),
        KILL_MARK: str(mark),
    }
    result = subprocess.run(
        ["bash", str(MULTINODE_SCRIPT), "examples/tiny_cpu/train.yaml", *overrides],
        cwd=REPO_ROOT,
        env={**subprocess_env(), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = result.stdout[-3000:] + result.stderr[-8000:]
    assert result.returncode == 0, log
    assert mark.exists(), log  # the rank was killed
    resumed = re.findall(
        r"rank (\d): torchrun restart count 1 \(TORCHELASTIC_RESTART_COUNT\): resumed from (\S+)",
        result.stderr,
    )
    assert sorted(rank for rank, _ in resumed) == ["0", "1"], log
    assert len({path for _, path in resumed}) == 1, resumed  # the same checkpoint
    assert Path(resumed[0][1]).name >= "step_00000001", resumed
    assert_same_run(
        read_metrics(output), two_process_run("tp2"), rollout_steps=3, updates=6, bitwise=True
    )
