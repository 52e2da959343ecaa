"""Dynamic sampling with refill: its settings refused by field, its prompt stream (disjoint
blocks per replica, whatever rounds each takes), and its position carried by checkpoints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bapo_megatron.config import check_training
from bapo_megatron.config.loading import load_config
from bapo_megatron.data.experience import ReplayBuffer
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.trainer.refill import refill_rows
from bapo_megatron.trainer.state import TrainerState
from tests.unit.test_config import TRAINABLE


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.filter_equal_groups=true", "algorithm.max_refill_rounds=0"],
            r"algorithm\.max_refill_rounds must be an integer >= 1, got 0",
        ),
        (
            ["algorithm.max_refill_rounds=2"],
            r"algorithm\.max_refill_rounds=2 refills .* algorithm\.filter_equal_groups",
        ),
        (
            ['algorithm.kl={"coef": 0.1, "reference": null}'],
            r"algorithm\.kl\.coef is 0\.1 but algorithm\.kl\.reference is null",
        ),
    ],
)
def test_bad_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [*TRAINABLE, *overrides])


def test_refill_with_partial_rollout_is_refused():
    cfg = load_config(
        None,
        [
            *TRAINABLE,
            "algorithm.filter_equal_groups=true",
            "algorithm.max_refill_rounds=1",
            "rollout.partial_tokens_per_round=4",
        ],
    )
    with pytest.raises(ValueError, match=r"max_refill_rounds=1 with rollout\.partial_tokens"):
        check_training(cfg)


def _replica(rank: int, replicas: int, per_replica: int, rows: int, shuffle: bool):
    cfg = SimpleNamespace(train=SimpleNamespace(seed=3), data=SimpleNamespace(shuffle=shuffle))
    return SimpleNamespace(
        cfg=cfg,
        context=SimpleNamespace(dp_size=replicas, dp_rank=rank),
        per_replica=per_replica,
        task=SimpleNamespace(
            rows=[PromptRow(id=str(i), prompt=str(i), answer="") for i in range(rows)]
        ),
    )


@pytest.mark.parametrize("shuffle", [True, False])
def test_replicas_refill_from_disjoint_blocks_of_one_stream(shuffle):
    replicas, per_replica, rows = 3, 2, 18  # 3 rounds of every replica: one epoch exactly
    seen = []
    for rank in range(replicas):
        run = _replica(rank, replicas, per_replica, rows, shuffle)
        for taken in range(3):
            chosen = refill_rows(run, taken)
            assert len(chosen) == per_replica
            seen += [row.id for row in chosen]
    assert sorted(seen, key=int) == [str(i) for i in range(rows)]  # nothing drawn twice
    # a pure function of the round: a resumed run draws the same rows again
    again = refill_rows(_replica(1, replicas, per_replica, rows, shuffle), 2)
    assert [r.id for r in again] == [r.id for r in refill_rows(_replica(1, 3, 2, 18, shuffle), 2)]
    if shuffle:  # its own order, not the main stream's
        assert [r.id for r in refill_rows(_replica(0, 1, 6, rows, True), 0)] != list("012345")


def test_refill_rounds_are_checkpointed_and_absent_means_none_taken():
    state = TrainerState(replay=ReplayBuffer(capacity=2, max_staleness=1), refill_rounds=5)
    saved = state.to_checkpoint()
    loaded = TrainerState(replay=ReplayBuffer(capacity=2, max_staleness=1))
    loaded.load_checkpoint(saved, "f.pt")
    assert loaded.refill_rounds == 5
    loaded.load_checkpoint({k: v for k, v in saved.items() if k != "refill_rounds"}, "f.pt")
    assert loaded.refill_rounds == 0
    with pytest.raises(ValueError, match=r"f\.pt: trainer_state\.refill_rounds is -1"):
        loaded.load_checkpoint(dict(saved, refill_rounds=-1), "f.pt")
