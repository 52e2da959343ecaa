"""Asynchronous training (``algorithm.max_staleness`` = eta >= 1) of the tiny run with one
trainer rank and one engine rank, started as torchrun would: the staleness bound on every
update, admission ahead of the trainer, resumption after SIGKILL with every rollout step
trained once, and the two ways one side can die, each bounded in time."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.e2e.test_train_disaggregated import finish, first_rollout_step  # noqa: E402
from tests.helpers.train_runs import (  # noqa: E402
    read_metrics,
    rollout_records,
    start_ranks,
    training_command,
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU runs"),
]
PROMPTS = 4  # rollout.prompts_per_step of the FAST runs


def asynchronous(eta: int, *more: str) -> list[str]:
    return [
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        f"algorithm.max_staleness={eta}",
        # one optimizer step per rollout step: the bound then holds on every update itself
        "algorithm.optimizer_steps_per_rollout=1",
        *more,
    ]


def run(tmp_path: Path, warm_start, *overrides: str) -> list[dict]:
    ranks = start_ranks(training_command(tmp_path, *warm_start[0], *overrides), 2)
    outputs = finish(ranks, 900)
    assert [r.returncode for r in ranks] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "engine stopped by its trainer" in outputs[1]
    return read_metrics(tmp_path)


def assert_each_step_trained_once(records: list[dict], steps: int) -> None:
    """Rollout steps 1..steps logged once each, and each accounts for all its prompts (the
    groups of rollout item j are the prompts j * PROMPTS .. (j + 1) * PROMPTS - 1 of the data
    order: trained, or dropped and counted)."""
    rollouts = rollout_records(records)
    assert [r["rollout_step"] for r in rollouts] == list(range(1, steps + 1))
    for record in rollouts:
        assert record["rollout/finished_groups"] + record["async/dropped_groups"] == PROMPTS


@pytest.mark.parametrize("eta", [1, 4])  # eta 2: the two-replica and SIGKILL runs below
def test_no_trained_token_is_older_than_eta(tmp_path, warm_start, eta):
    steps = 5
    records = run(tmp_path, warm_start, f"train.steps={steps}", *asynchronous(eta))
    updates = [r for r in records if "staleness/max" in r]
    assert len(updates) == steps
    for update in updates:  # from the per-token versions of every update's batch
        assert 0 <= update["staleness/max"] <= eta, update
        assert sum(update[f"staleness/share_{i}"] for i in range(eta + 1)) == pytest.approx(1)
    assert_each_step_trained_once(records, steps)
    rollouts = rollout_records(records)
    # the engine was given the next eta items ahead of the trainer at once
    assert rollouts[0]["async/queued_items"] == min(eta + 1, steps)
    assert all(r["async/dropped_groups"] == 0 for r in rollouts)  # admission kept within eta
    assert all(r["async/weight_update_bytes"] > 0 for r in rollouts)
    assert [r["policy_version"] for r in rollouts] == list(range(1, steps + 1))


def test_two_replicas_each_with_its_engine_rank_resuming_samples_from_their_prefix(
    tmp_path, warm_start
):
    # data-parallel trainer of 2 ranks, engine ranks 2 and 3; an update in flight pauses the
    # samples and resumes them from their prefix under the new weights
    overrides = [
        "train.steps=4",
        "rollout.engine_ranks=2",
        "rollout.inflight_update=resume",
        "rollout.prompts_per_step=8",
    ]
    ranks = start_ranks(training_command(tmp_path, *warm_start[0], *asynchronous(2), *overrides), 4)
    outputs = finish(ranks, 900)
    assert [r.returncode for r in ranks] == [0] * 4, "\n".join(o[-4000:] for o in outputs)
    assert all("engine stopped by its trainer" in o for o in outputs[2:])
    records = read_metrics(tmp_path)
    rollouts = rollout_records(records)
    assert [r["rollout_step"] for r in rollouts] == [1, 2, 3, 4]
    for record in rollouts:  # both replicas' groups, summed
        assert record["rollout/finished_groups"] + record["async/dropped_groups"] == 8
    assert rollouts[0]["async/queued_items"] == 3  # per replica: this step's and 2 ahead
    assert max(r["staleness/max"] for r in records if "staleness/max" in r) <= 2


def test_sigkill_resumes_with_every_step_trained_once(tmp_path, warm_start):
    overrides = ["train.steps=6", "checkpoint.interval=2", *asynchronous(2)]
    command = training_command(tmp_path, *warm_start[0], *overrides)
    ranks = start_ranks(command, 2)
    wait_for_rollout_step(tmp_path, ranks, 3)
    ranks[0].send_signal(signal.SIGKILL)
    finish(ranks, 300)
    assert ranks[1].returncode not in (0, None)  # the engine rank did not outlive its trainer
    resumed = start_ranks(command, 2)
    outputs = finish(resumed, 900)
    assert [r.returncode for r in resumed] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "resumed from" in outputs[0]
    records = read_metrics(tmp_path)
    assert_each_step_trained_once(records, 6)
    assert max(r["staleness/max"] for r in records if "staleness/max" in r) <= 2


def wait_for_rollout_step(output_dir: Path, ranks, step: int) -> None:
    """Wait until rollout step ``step`` is logged (its checkpoint, if any, is written after)."""
    first_rollout_step(output_dir, ranks)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = [r["rollout_step"] for r in rollout_records(read_metrics(output_dir))]
        if done and max(done) >= step:
            return
        assert all(rank.poll() is None for rank in ranks), finish(ranks, 10)
        time.sleep(0.5)
    finish(ranks, 1)
    pytest.fail(f"the run did not reach rollout step {step} within 600 s")


def test_killed_engine_rank_stops_the_trainer_naming_it(tmp_path, warm_start):
    ranks = start_ranks(
        training_command(tmp_path, *warm_start[0], "train.steps=40", *asynchronous(1)), 2
    )
    first_rollout_step(tmp_path, ranks)
    ranks[1].send_signal(signal.SIGKILL)
    outputs = finish(ranks, 300)
    assert ranks[0].returncode not in (0, None)
    assert "EngineFailure" in outputs[0] and "engine rank 1" in outputs[0], outputs[0][-3000:]


def test_killed_trainer_ends_the_engine_rank(tmp_path, warm_start):
    ranks = start_ranks(
        training_command(tmp_path, *warm_start[0], "train.steps=40", *asynchronous(1)), 2
    )
    first_rollout_step(tmp_path, ranks)
    ranks[0].send_signal(signal.SIGKILL)
    outputs = finish(ranks, 300)
    assert ranks[1].returncode not in (0, None)
    assert "PeerLost" in outputs[1] and "trainer rank 0" in outputs[1], outputs[1][-3000:]
