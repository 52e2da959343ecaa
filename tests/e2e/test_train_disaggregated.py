"""The tiny run with its engine on a rank of its own (``rollout.placement=disaggregated``: one
trainer rank, one engine rank, started as torchrun would), against the colocated synchronous run
in one process with the same seeds; the same with a tensor- or pipeline-parallel trainer (two
trainer ranks, one engine rank); and the two ways one side can die, each bounded in time."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.helpers.train_runs import (  # noqa: E402
    assert_same_run,
    read_metrics,
    rollout_records,
    run_in_process,
    start_ranks,
    training_command,
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs"),
]
DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]
STEPS = ["train.steps=3"]
LAYOUTS = {
    "tp2": "parallel.tensor_model_parallel_size=2",
    "pp2": "parallel.pipeline_model_parallel_size=2",
}


def finish(ranks: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every rank (killing all of them if one outlives ``timeout``); their output."""
    try:
        return [rank.communicate(timeout=timeout)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()


def first_rollout_step(output_dir: Path, ranks: list[subprocess.Popen]) -> None:
    """Wait until the run has logged its first rollout step (both ranks then hold their links)."""
    path = output_dir / "tensorboard" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        dead = [i for i, rank in enumerate(ranks) if rank.poll() is not None]
        assert not dead, f"rank(s) {dead} ended early:\n" + "\n".join(finish(ranks, 10))
        if path.exists() and any(
            "reward/mean" in json.loads(line)
            for line in path.read_text().splitlines()
            if line.strip().endswith("}")
        ):
            return
        time.sleep(0.5)
    finish(ranks, 1)
    pytest.fail("the run logged no rollout step within 600 s")


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, warm_start):
    """The colocated synchronous run in one process (trainer TP1, PP1)."""
    return run_in_process(tmp_path_factory.mktemp("colocated"), *warm_start[0], *STEPS)


def test_eta0_disaggregated_run_matches_the_colocated_run(tmp_path, warm_start, colocated):
    ranks = start_ranks(
        training_command(tmp_path / "split", *warm_start[0], *STEPS, *DISAGGREGATED), 2
    )
    outputs = finish(ranks, 900)
    assert [r.returncode for r in ranks] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "answered" in outputs[1]  # the engine rank served, then was stopped by its trainer
    assert_same_run(
        read_metrics(tmp_path / "split"), colocated, rollout_steps=3, updates=6, bitwise=True
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_trainer_with_an_engine_rank_matches_the_one_process_run(
    tmp_path, warm_start, colocated, layout
):
    # Two trainer ranks (tensor-parallel: the export gathers the shards on TP rank 0; pipeline:
    # each stage's export rank broadcasts its own layers) and one engine rank. The rollouts equal
    # the one-process run's exactly, so after every broadcast the engine holds the same HF
    # weights as the one-process engine; and at every step the engine's log-probs of the tokens
    # it sampled under the new version match the actor's (measured without changing the run:
    # the ratio is still taken against the engine's log-probs).
    command = training_command(
        tmp_path,
        *warm_start[0],
        *STEPS,
        LAYOUTS[layout],
        *DISAGGREGATED,
        "logging.logprob_diff_interval=1",
    )
    ranks = start_ranks(command, 3)
    outputs = finish(ranks, 900)
    assert [r.returncode for r in ranks] == [0, 0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "answered" in outputs[2]
    records = read_metrics(tmp_path)
    assert_same_run(records, colocated, rollout_steps=3, updates=6)
    for step in rollout_records(records):
        assert step["logprob_diff/tokens"] == step["rollout/generated_tokens"] > 0
        assert step["logprob_diff/max_abs"] < 1e-4, step["logprob_diff/max_abs"]


def test_killed_engine_rank_stops_the_trainer_naming_it(tmp_path, warm_start):
    ranks = start_ranks(
        training_command(tmp_path, *warm_start[0], "train.steps=40", *DISAGGREGATED), 2
    )
    first_rollout_step(tmp_path, ranks)
    ranks[1].send_signal(signal.SIGKILL)
    outputs = finish(ranks, 300)
    assert ranks[0].returncode not in (0, None)
    assert "EngineFailure" in outputs[0] and "engine rank 1" in outputs[0], outputs[0][-3000:]


def test_killed_trainer_ends_the_engine_rank(tmp_path, warm_start):
    ranks = start_ranks(
        training_command(tmp_path, *warm_start[0], "train.steps=40", *DISAGGREGATED), 2
    )
    first_rollout_step(tmp_path, ranks)
    ranks[0].send_signal(signal.SIGKILL)
    outputs = finish(ranks, 300)
    assert ranks[1].returncode not in (0, None)  # ended by itself, not by finish()'s kill
    assert "PeerLost" in outputs[1] and "trainer rank 0" in outputs[1], outputs[1][-3000:]
