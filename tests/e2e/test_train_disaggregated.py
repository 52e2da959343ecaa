"""The tiny run with its engine on a rank of its own (``rollout.placement=disaggregated``) and a
tensor- or pipeline-parallel trainer (two trainer ranks, one engine rank, started as torchrun
would), against the colocated synchronous run in one process with the same seeds. The same run
with one trainer rank and one engine rank is test_multinode_launch.py's two-agent run, compared
bitwise with the same colocated run. The two ways one side can die are tested in
test_train_async.py, at eta 0 and 1."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.train_runs import (
    assert_same_run,
    read_metrics,
    rollout_records,
    start_ranks,
    training_command,
)

pytestmark = [
    pytest.mark.multiprocess,
]
DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]
STEPS = ["train.steps=3"]  # as the one-process run (conftest.colocated_three_steps)
LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    # each stage's rank sends its own layers' shards straight to the engine rank
    "pp2-shard-to-shard": [
        "parallel.pipeline_model_parallel_size=2",
        "rollout.weight_transport=shard-to-shard",
    ],
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


@pytest.fixture
def colocated(colocated_three_steps):
    """The colocated synchronous run in one process (trainer TP1, PP1), of STEPS; shared with
    the other files that compare with it."""
    return colocated_three_steps


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
        *LAYOUTS[layout],
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
