"""Disaggregated placement's settings: refused alone (``rollout``), across sections
(``check_training``) and against the world (:func:`split_world`), each naming the setting."""

from __future__ import annotations

import pytest

from bapo_megatron.config import ParallelConfig, RolloutConfig, check_training
from bapo_megatron.config.loading import load_config
from bapo_megatron.distributed.layout import split_world
from tests.unit.test_config import TRAINABLE

SPLIT = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.placement=disaggregated"], r"needs rollout\.engine_ranks >= 1"),
        (["rollout.engine_ranks=2"], r"rollout\.engine_ranks=2 applies to .*disaggregated"),
        (["rollout.placement=elsewhere"], r"rollout\.placement: expected one of"),
        (["rollout.engine_ranks=-1"], r"rollout\.engine_ranks must be an integer >= 0"),
    ],
)
def test_bad_placement_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.release_memory_during_training=true"], "release_memory_during_training"),
    ],
)
def test_what_a_disaggregated_run_cannot_do_is_refused(overrides, message):
    cfg = load_config(None, [*TRAINABLE, *SPLIT, *overrides])
    with pytest.raises(ValueError, match=message):
        check_training(cfg)


def test_servers_are_engines_without_ranks():
    servers = ["rollout.engine=vllm-server", "rollout.server_urls=[http://a:1]"]
    with pytest.raises(ValueError, match=r"servers at rollout\.server_urls, which have no rank"):
        load_config(None, [*TRAINABLE, *SPLIT, *servers])
    asynchronous = [
        *TRAINABLE,
        *servers,
        "rollout.placement=disaggregated",
        "algorithm.max_staleness=1",
        "rollout.inflight_update=resume",
    ]
    check_training(load_config(None, asynchronous))


def test_a_disaggregated_config_trains():
    check_training(load_config(None, [*TRAINABLE, *SPLIT]))
    check_training(load_config(None, [*TRAINABLE, *SPLIT, "algorithm.max_staleness=2"]))
    shards = "rollout.weight_transport=shard-to-shard"
    check_training(load_config(None, [*TRAINABLE, *SPLIT, shards]))
    check_training(load_config(None, [*TRAINABLE, *SPLIT, shards, "algorithm.max_staleness=2"]))


ASYNC = [*SPLIT, "algorithm.max_staleness=1"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.max_staleness=1"], r"max_staleness=1 .* needs rollout\.placement=disagg"),
        (["rollout.sync_interval=2"], r"rollout\.sync_interval=2 applies to asynchronous"),
        ([*ASYNC, "rollout.sync_interval=3"], r"sync_interval=3 .* \(use at most 2\)"),
        ([*ASYNC, "algorithm.rollout_lag=1"], r"algorithm\.rollout_lag=1 imitates staleness"),
        ([*ASYNC, "algorithm.replay_fraction=0.5"], r"algorithm\.replay_fraction=0\.5"),
        (
            [*ASYNC, "rollout.partial_tokens_per_round=4"],
            r"rollout\.partial_tokens_per_round=4 imitates",
        ),
        (
            [*ASYNC, "rollout.engine=vllm"],
            r"inflight_update=continue .* rollout\.engine='vllm' takes .*=resume",
        ),
    ],
)
def test_what_asynchronous_training_cannot_do_is_refused(overrides, message):
    cfg = load_config(None, [*TRAINABLE, *overrides])
    with pytest.raises(ValueError, match=message):
        check_training(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.max_staleness=-1"], r"algorithm\.max_staleness must be an integer >= 0"),
        (["rollout.sync_interval=0"], r"rollout\.sync_interval must be an integer >= 1"),
        (["rollout.inflight_update=later"], r"rollout\.inflight_update: expected one of"),
    ],
)
def test_bad_asynchronous_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def rollout(engines: int, prompts: int = 8) -> RolloutConfig:
    return RolloutConfig(placement="disaggregated", engine_ranks=engines, prompts_per_step=prompts)


def test_the_world_splits_into_trainer_and_engine_ranks():
    parallel = ParallelConfig(tensor_model_parallel_size=2)
    split = split_world(parallel, rollout(2), 6)
    assert (split.trainer_size, split.data_parallel_size) == (4, 2)
    assert [split.is_engine(r) for r in range(6)] == [False] * 4 + [True] * 2
    assert [split.engine_index(r) for r in (4, 5)] == [0, 1]
    assert [split.engine_rank(i) for i in (0, 1)] == [4, 5]
    with pytest.raises(ValueError, match="rank 3 is a trainer rank"):
        split.engine_index(3)


@pytest.mark.parametrize(
    ("world", "engines", "prompts", "message"),
    [
        (1, 1, 8, r"leaves no trainer rank .*rollout\.engine_ranks"),
        (4, 1, 8, r"leaves 3 trainer ranks, not divisible by .* = 2"),
        (5, 1, 8, r"rollout\.engine_ranks=1 must equal the trainer's data-parallel size 2"),
        (9, 3, 8, r"rollout\.prompts_per_step \(8\) must be a multiple of .* \(3\)"),
    ],
)
def test_bad_splits_are_refused_naming_the_setting(world, engines, prompts, message):
    parallel = ParallelConfig(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match=message):
        split_world(parallel, rollout(engines, prompts), world)
