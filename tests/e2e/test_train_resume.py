"""Checkpoints and resume of the training loop: a run killed with SIGKILL resumes from its last
complete checkpoint and then logs exactly the metrics of an uninterrupted run (CPU, fixed
seed), with the replay buffer and partial-rollout state carried across."""

from __future__ import annotations

import pytest

from bapo_megatron.device_check import loop_runs
from bapo_megatron.trainer.checkpoint import latest_checkpoint
from tests.helpers.train_runs import (
    kill_after,
    read_metrics,
    rollout_records,
    run_in_process,
)

# Values that must repeat exactly (times and throughput do not), and the records compared: the
# device check's resume check judges a GPU resume by the same rule.
comparable = loop_runs.comparable


@pytest.mark.parametrize(
    "mode, overrides, delay",
    [
        # replay with the example's two mini-batches per rollout step, killed while checkpoint 3
        # is being written (delay None)
        ("replay", ["algorithm.replay_fraction=0.5"], None),
        (
            "partial",
            ["rollout.partial_tokens_per_round=6", "algorithm.optimizer_steps_per_rollout=1"],
            0.3,
        ),
        (  # refill rounds (their prompt stream's position) and the KL reference read anew
            "refill-kl",
            [
                "algorithm.filter_equal_groups=true",
                "algorithm.max_refill_rounds=2",
                'algorithm.kl={"coef": 0.5, "placement": "reward"}',
            ],
            0.3,
        ),
    ],
)
def test_resume_after_sigkill_equals_the_uninterrupted_run(
    tmp_path, warm_start, mode, overrides, delay
):
    common = [
        *warm_start[0],
        *overrides,
        "train.steps=5",
        "checkpoint.interval=1",
        "checkpoint.keep_last=2",
    ]
    uninterrupted = run_in_process(tmp_path / "whole", *common)

    killed = tmp_path / "killed"
    if delay is None:
        kill_after(killed, common, checkpoint_step=3, extra_delay=0.0, while_writing=True)
        staged = sorted(p.name for p in (killed / "checkpoints").iterdir())
        assert ".step_00000003.incomplete" in staged, staged  # the kill hit the write
        assert latest_checkpoint(killed / "checkpoints").name == "step_00000002"
    else:
        kill_after(killed, common, checkpoint_step=2, extra_delay=delay)
    survivor = latest_checkpoint(killed / "checkpoints")
    assert survivor is not None and survivor.name >= "step_00000002"
    resumed = run_in_process(killed, *common)

    assert comparable(resumed) == comparable(uninterrupted)
    if mode == "refill-kl":
        keys = ("dynamic_sampling/refill_rounds", "kl/reward_penalty", "rollout/finished_groups")
        assert [{k: r[k] for k in keys} for r in rollout_records(resumed)] == [
            {k: r[k] for k in keys} for r in rollout_records(uninterrupted)
        ]
        assert any(r["dynamic_sampling/refill_rounds"] for r in rollout_records(uninterrupted))
    assert [r["rollout_step"] for r in rollout_records(read_metrics(killed))] == [1, 2, 3, 4, 5]
    folders = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert folders == ["step_00000004", "step_00000005"]  # keep_last=2, no staging left behind


def test_finished_run_does_not_train_again(tmp_path, warm_start, capsys):
    common = [*warm_start[0], "train.steps=2", "algorithm.optimizer_steps_per_rollout=1"]
    first = run_in_process(tmp_path, *common)
    capsys.readouterr()
    again = run_in_process(tmp_path, *common)
    assert comparable(again) == comparable(first)
    assert "already holds a run finished at rollout step 2" in capsys.readouterr().out
    # asked for one more step, it trains that step only (in this process; a resume by the
    # command line: test_train_async.py's SIGKILL test)
    records = rollout_records(run_in_process(tmp_path, *common, "train.steps=3"))
    assert [r["rollout_step"] for r in records] == [1, 2, 3]
