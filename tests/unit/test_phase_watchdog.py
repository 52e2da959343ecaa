"""The phase watchdog: reports which rank is behind from the store, once per stalled phase, and
adds the report to an error raised inside a phase. Times are injected (no sleeping)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from bapo_megatron.distributed.watchdog import PhaseWatchdog, stall_report


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_report_names_the_rank_that_has_not_reached_the_phase():
    store, clock = dist.HashStore(), Clock()
    ranks = [PhaseWatchdog(store, rank, 3, stall_s=60, clock=clock) for rank in range(3)]
    for watchdog in ranks:
        watchdog.enter("step 4: rollout")
    clock.now += 5
    ranks[0].enter("step 4: train")
    ranks[1].enter("step 4: train")  # rank 2 froze in rollout
    clock.now += 30
    assert ranks[0].check() is None  # 30 s < stall_s
    clock.now += 40
    report = ranks[0].check()
    assert report == (
        "rank 0 in 'step 4: train' since 70 s; rank 2 has not reached 'step 4: train': "
        "it is in 'step 4: rollout' since 75 s"
    )
    assert ranks[0].check() is None  # logged once per phase
    ranks[0].enter("step 4: weight sync")
    clock.now += 61
    assert "rank 1 has not reached 'step 4: weight sync'" in ranks[0].check()


def test_a_rank_that_never_reported_and_ranks_in_step():
    assert (
        stall_report({0: ("a", 0.0), 1: None}, 0, 10.0)
        == "rank 0 in 'a' since 10 s; rank 1 has not reported any phase"
    )
    assert (
        stall_report({0: ("a", 0.0), 1: ("a", 2.0)}, 0, 10.0)
        == "rank 0 in 'a' since 10 s; every other rank reports the same phase"
    )


def test_an_error_inside_a_phase_carries_the_report():
    store, clock = dist.HashStore(), Clock()
    late = PhaseWatchdog(store, 1, 2, stall_s=60, clock=clock)
    late.enter("step 0: rollout")
    watchdog = PhaseWatchdog(store, 0, 2, stall_s=60, clock=clock)
    with pytest.raises(RuntimeError) as raised, watchdog.phase("step 0: train"):
        clock.now += 12
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    assert raised.value.__notes__ == [
        "where the ranks are: rank 0 in 'step 0: train' since 12 s; rank 1 has not reached "
        "'step 0: train': it is in 'step 0: rollout' since 12 s"
    ]
