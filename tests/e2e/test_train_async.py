"""Asynchronous training (``algorithm.max_staleness`` = eta >= 1) of the tiny run with one
trainer rank and one engine rank, started as torchrun would: the staleness bound on every
update, admission ahead of the trainer, resumption after SIGKILL with every rollout step
trained once, and the two ways one side can die (also for the synchronous disaggregated loop,
eta 0), each bounded in time and each at a point the test makes certain."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_disaggregated import finish
from tests.helpers.fault_rewards import HANG_AFTER, HANG_FILE
from tests.helpers.train_runs import (
    read_metrics,
    rollout_records,
    start_ranks,
    training_command,
)

pytestmark = [
    pytest.mark.multiprocess,
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
    order, and each refill round's PROMPTS more: trained, filtered, or dropped and counted)."""
    rollouts = rollout_records(records)
    assert [r["rollout_step"] for r in rollouts] == list(range(1, steps + 1))
    for record in rollouts:
        rounds = record.get("dynamic_sampling/refill_rounds", 0.0)
        generated = record["rollout/finished_groups"] + record["async/dropped_groups"]
        assert generated == PROMPTS * (1 + rounds)


@pytest.mark.parametrize(  # eta 2: the two-replica and SIGKILL runs below
    ("eta", "transport"), [(1, "process-group"), (4, "process-group"), (1, "shard-to-shard")]
)
def test_no_trained_token_is_older_than_eta(tmp_path, warm_start, eta, transport):
    # shard to shard, each update is written into the engine between two of its tokens
    steps = 5
    transported = f"rollout.weight_transport={transport}"
    records = run(tmp_path, warm_start, f"train.steps={steps}", *asynchronous(eta, transported))
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
    if transport == "shard-to-shard":  # each update written into the engine counts as a load
        assert sum(r["async/engine_weight_loads"] for r in rollouts) >= 1


def test_refill_rounds_keep_the_staleness_bound_and_account_for_every_group(tmp_path, warm_start):
    # refill rounds are items of their own, generated after the items admitted ahead
    steps, eta = 4, 1
    refill = ["algorithm.filter_equal_groups=true", "algorithm.max_refill_rounds=2"]
    records = run(tmp_path, warm_start, f"train.steps={steps}", *asynchronous(eta, *refill))
    for update in (r for r in records if "staleness/max" in r):
        assert 0 <= update["staleness/max"] <= eta, update
    rollouts = rollout_records(records)
    assert [r["rollout_step"] for r in rollouts] == list(range(1, steps + 1))
    assert any(r["dynamic_sampling/refill_rounds"] for r in rollouts)
    for r in rollouts:  # every round's prompts: trained, filtered, surplus or dropped as stale
        rounds = r["dynamic_sampling/refill_rounds"]
        assert r["rollout/finished_groups"] == PROMPTS * (1 + rounds)
        assert r["async/dropped_groups"] == 0  # admission kept within eta


def test_weights_reach_the_engines_every_sync_interval_versions(tmp_path):
    # eta 2, a push once 3 versions are new (the most eta allows): the engines hold version 0
    # for rollout steps 1-3 and version 3 from then on. No warm-start checkpoint: rewards do not
    # matter here, only which weights sampled which item.
    steps = 5
    records = run(
        tmp_path, ([], None), f"train.steps={steps}", *asynchronous(2, "rollout.sync_interval=3")
    )
    assert_each_step_trained_once(records, steps)
    rollouts = rollout_records(records)
    # pushed after the training of rollout step 3 (version 3) only
    assert [r["async/pushed_version"] for r in rollouts] == [0, 0, 3, 3, 3]
    # bytes sent during each step: the first step's count the run's initial push (version 0),
    # the third's the one update, of the same size
    sent = [r["async/weight_update_bytes"] for r in rollouts]
    assert sent[0] == sent[2] > 0 and sent[1] == sent[3] == sent[4] == 0
    assert [r["async/engine_versions_behind"] for r in rollouts] == [1, 2, 0, 1, 2]
    # item j trains at version j on the weights the engines had when it was admitted: items
    # 0-2 on version 0 (the third exactly eta old), items 3-4 on version 3
    assert [r["staleness/max"] for r in records if "staleness/max" in r] == [0, 1, 2, 0, 1]
    assert all(r["async/dropped_groups"] == 0 for r in rollouts)


@pytest.mark.parametrize("transport", ["process-group", "shard-to-shard"])
def test_two_replicas_each_with_its_engine_rank_resuming_samples_from_their_prefix(
    tmp_path, warm_start, transport
):
    # data-parallel trainer of 2 ranks, engine ranks 2 and 3; an update in flight pauses the
    # samples and resumes them from their prefix under the new weights. Shard to shard, both
    # trainer ranks send into both engine ranks once these reach a boundary.
    overrides = [
        "train.steps=4",
        "rollout.engine_ranks=2",
        "rollout.inflight_update=resume",
        "rollout.prompts_per_step=8",
        f"rollout.weight_transport={transport}",
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
    assert all(r["async/weight_update_bytes"] > 0 for r in rollouts)


@pytest.mark.parametrize("refill", [False, True], ids=["plain", "refill"])
def test_sigkill_resumes_with_every_step_trained_once(tmp_path, warm_start, refill):
    # 1. the run is killed (SIGKILL) while it is certainly inside rollout step 3 (its rewards
    # hang once checkpoint 2 exists, written at the end of step 2) with items 3-5 admitted to
    # the engine; 2. the resumed run redoes step 3 and finishes: every step logged once (with
    # dynamic sampling's refill, every refill round's groups accounted for too)
    hang = tmp_path / "hang"
    more = ["algorithm.filter_equal_groups=true", "algorithm.max_refill_rounds=2"] if refill else []
    overrides = [*warm_start[0], "checkpoint.interval=2", *HELD, *asynchronous(2, *more)]
    told = {
        HANG_FILE: str(hang),
        HANG_AFTER: str(tmp_path / "checkpoints" / "step_00000002"),
    }
    command = training_command(tmp_path, *overrides, "train.steps=6")
    hang.touch()
    killed = start_ranks(command, 2, told)
    wait_for_file(tmp_path / "hang.reached", killed)
    killed[0].send_signal(signal.SIGKILL)
    outputs = finish(killed, 300)
    # the engine rank did not outlive its trainer: it stopped by itself, naming it
    assert killed[1].returncode not in (0, None, -signal.SIGKILL), outputs[1][-3000:]
    assert "PeerLost" in outputs[1] and "trainer rank 0" in outputs[1], outputs[1][-3000:]
    assert [r["rollout_step"] for r in rollout_records(read_metrics(tmp_path))] == [1, 2]
    hang.unlink()
    resumed = start_ranks(command, 2, told)
    outputs = finish(resumed, 900)
    assert [r.returncode for r in resumed] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    assert "resumed from" in outputs[0] and "step_00000002" in outputs[0]
    records = read_metrics(tmp_path)
    assert_each_step_trained_once(records, 6)
    assert max(r["staleness/max"] for r in records if "staleness/max" in r) <= 2


def wait_for_file(path: Path, ranks) -> None:
    """Wait until ``path`` exists (the ranks all still running)."""
    deadline = time.monotonic() + 600
    while not path.exists():
        assert all(rank.poll() is None for rank in ranks), finish(ranks, 10)
        if time.monotonic() > deadline:
            finish(ranks, 1)
            pytest.fail(f"{path.name} did not appear within 600 s")
        time.sleep(0.2)


HELD = [
    "reward.name=tests.helpers.fault_rewards:hangs_while_told",
    "reward.timeout_s=3600",
    "reward.batch_timeout_s=3600",
]


def held_in_first_step(
    tmp_path: Path, warm_start, eta: int, *more: str
) -> tuple[list, Path]:
    """A disaggregated run (synchronous at eta 0) whose trainer is certainly inside its first
    rollout step (its rewards wait until the returned file is removed), its engine rank
    serving."""
    hang = tmp_path / "hang"
    hang.touch()
    overrides = ["train.steps=4", *HELD, *asynchronous(eta, *more)]
    command = training_command(tmp_path, *warm_start[0], *overrides)
    ranks = start_ranks(command, 2, {HANG_FILE: str(hang)})
    wait_for_file(tmp_path / "hang.reached", ranks)
    return ranks, hang


@pytest.mark.parametrize("transport", ["process-group", "shard-to-shard"])
@pytest.mark.parametrize("eta", [0, 1])
def test_killed_engine_rank_stops_the_trainer_naming_it(tmp_path, warm_start, eta, transport):
    # the trainer meets the dead engine rank when it next pushes weights (shard to shard: in the
    # transfer group and on the request link) or asks for rollouts
    more = f"rollout.weight_transport={transport}"
    ranks, hang = held_in_first_step(tmp_path, warm_start, eta, more)
    ranks[1].send_signal(signal.SIGKILL)
    ranks[1].wait(60)
    hang.unlink()  # the trainer goes on, and meets the dead engine rank
    outputs = finish(ranks, 300)
    assert ranks[0].returncode not in (0, None, -signal.SIGKILL)
    assert "EngineFailure" in outputs[0] and "engine rank 1" in outputs[0], outputs[0][-3000:]


def test_killed_trainer_ends_the_engine_rank(tmp_path, warm_start):
    """At eta 0; an asynchronous run's killed trainer (eta 2) is the SIGKILL test's, which
    checks the same of its engine rank."""
    ranks, _ = held_in_first_step(tmp_path, warm_start, 0)
    ranks[0].send_signal(signal.SIGKILL)
    outputs = finish(ranks, 300)
    assert ranks[1].returncode not in (0, None, -signal.SIGKILL)  # ended by itself
    assert "PeerLost" in outputs[1] and "trainer rank 0" in outputs[1], outputs[1][-3000:]
