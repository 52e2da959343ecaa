"""End-to-end runs of the training loop with a tiny Qwen3-MoE (examples/tiny_cpu_moe): synchronous,
with routing replay R3 (the embedded engine's routes replayed by the actor) and R2 (the routes of
the actor's own old-log-prob pass), and the pieces that carry routes from the engine to the
actor: the training batch and the checkpointed samples."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_megatron.data.experience import (  # noqa: E402
    Group,
    sample_from_plain,
    sample_to_plain,
    to_policy_batch,
)
from bapo_megatron.rollout.protocol import RolloutSample  # noqa: E402
from tests.e2e.test_train_disaggregated import finish  # noqa: E402
from tests.helpers.train_runs import (  # noqa: E402
    REPO_ROOT,
    assert_same_run,
    kill_after,
    read_metrics,
    rollout_records,
    run_in_process,
    start_ranks,
    training_command,
)

MOE_CONFIG = REPO_ROOT / "examples" / "tiny_cpu_moe" / "train.yaml"


def optimizer_records(records):
    return [r for r in records if "loss" in r and "reward/mean" not in r]


@pytest.mark.parametrize(
    "replay",
    [
        pytest.param(["algorithm.routing_replay=rollout"], id="R3"),
        pytest.param(
            ["algorithm.routing_replay=trainer", "algorithm.old_logprobs=recompute"], id="R2"
        ),
    ],
)
def test_moe_run_trains_with_routing_replay(tmp_path, replay):
    records = run_in_process(
        tmp_path, *replay, "train.steps=3", "logging.logprob_diff_interval=1", config=MOE_CONFIG
    )
    rollouts = rollout_records(records)
    assert len(rollouts) == 3
    steps = [r for r in optimizer_records(records) if r.get("step", 0) >= 0]
    assert steps and all(math.isfinite(r["loss"]) and r["skipped"] == 0 for r in steps)
    assert all(0 < r["moe/aux_loss"] < 1 for r in steps)  # coefficient 0.01, per layer ~1
    # the actor reproduces the engine's log-probs on the tokens it sampled with these weights
    gaps = [r["logprob_diff/max_abs"] for r in rollouts if r.get("logprob_diff/tokens")]
    assert gaps and max(gaps) < 1e-3
    # engine and actor route alike (both float32, same weights), and the load is reported
    for r in rollouts:
        assert 0 <= r["moe/router_disagreement"] < 0.01
        assert r["moe/logprob_gap_live"] < 1e-4
        assert 1 <= r["moe/expert_load_max_over_mean"] <= 4  # 4 experts


def test_routes_survive_lag_and_the_replay_buffer(tmp_path):
    """R3 with a rollout lag of 1 and half of each batch from the replay buffer: the batches
    built from queued and replayed groups still carry the engine's routes (the router metrics,
    which need them, are there on every step that trains)."""
    records = run_in_process(
        tmp_path,
        "train.steps=4",
        "algorithm.rollout_lag=1",
        "algorithm.replay_fraction=0.5",
        "logging.logprob_diff_interval=1",
        config=MOE_CONFIG,
    )
    trained = [r for r in rollout_records(records) if r["rollout_step"] > 1]
    assert len(trained) == 3
    for r in trained:
        assert 0 <= r["moe/router_disagreement"] <= 1
        assert r["moe/expert_load_max_over_mean"] >= 1


@pytest.mark.multiprocess
def test_asynchronous_moe_run_replays_routes_that_crossed_the_queue(tmp_path):
    """eta 2 with the engine on a rank of its own: samples (and their routes) reach the trainer
    through the asynchronous queue; the router metrics, which need the engine's routes on the
    trainer's side, are there every step."""
    command = training_command(
        tmp_path,
        "train.steps=3",
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        "algorithm.max_staleness=2",
        "algorithm.optimizer_steps_per_rollout=1",
        "logging.logprob_diff_interval=1",
        config=MOE_CONFIG,
    )
    ranks = start_ranks(command, 2)
    outputs = finish(ranks, 900)
    assert [r.returncode for r in ranks] == [0, 0], "\n".join(o[-4000:] for o in outputs)
    rollouts = rollout_records(read_metrics(tmp_path))
    assert [r["rollout_step"] for r in rollouts] == [1, 2, 3]
    for r in rollouts:
        assert 0 <= r["moe/router_disagreement"] <= 1
        assert math.isfinite(r["moe/logprob_gap_live"])


def test_moe_resume_after_sigkill_equals_the_uninterrupted_run(tmp_path):
    """R3 with partial rollout: the experts' weights and optimizer state and the paused samples
    come back from the checkpoint (a continued sample's routes are recorded again when the
    engine re-runs its context)."""
    from tests.e2e import test_train_resume as resume

    common = [
        "train.steps=4",
        "checkpoint.interval=1",
        "checkpoint.keep_last=2",
        "rollout.partial_tokens_per_round=6",
        "algorithm.optimizer_steps_per_rollout=1",
    ]
    uninterrupted = run_in_process(tmp_path / "whole", *common, config=MOE_CONFIG)
    killed = tmp_path / "killed"
    kill_after(killed, common, checkpoint_step=2, extra_delay=0.2, config=MOE_CONFIG)
    resumed = run_in_process(killed, *common, config=MOE_CONFIG)
    assert resume.comparable(resumed) == resume.comparable(uninterrupted)
    assert [r["rollout_step"] for r in rollout_records(read_metrics(killed))] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def moe_start(tmp_path_factory):
    """The tiny MoE run after its warm-up and one RL step, as a trainer checkpoint that loads at
    any layout (so that two layouts start from bitwise the same weights)."""
    output = tmp_path_factory.mktemp("moe_start")
    # a warm-up long enough that the compared runs earn rewards (20 steps of 16 leave them at 0)
    run_in_process(
        output, "train.steps=1", "warmup.steps=100", "warmup.batch_size=64", config=MOE_CONFIG
    )
    return ["warmup.steps=0", f"train.load_checkpoint={output / 'checkpoints' / 'step_00000001'}"]


@pytest.mark.multiprocess
def test_tp2_sp_ep2_run_matches_one_process(tmp_path, moe_start):
    """Two processes holding half of the attention (TP2, sequence parallel) and half of the
    experts (EP2) each: the colocated engine on rank 0 gets the other rank's experts through the
    weight sync (broadcast over the expert-parallel group), so it samples exactly what the
    one-process run samples, and the updates agree to float rounding."""
    one = run_in_process(tmp_path / "one", *moe_start, "train.steps=3", config=MOE_CONFIG)
    layout = [
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        "parallel.expert_model_parallel_size=2",
    ]
    records = run_ranks(tmp_path / "two", [*moe_start, "train.steps=3", *layout], 2)
    assert_same_run(records, one, rollout_steps=3, updates=6)


def run_ranks(output, overrides: list[str], processes: int) -> list[dict]:
    """The tiny MoE run with ``overrides`` on ``processes`` ranks started as torchrun would;
    its metrics."""
    ranks = start_ranks(training_command(output, *overrides, config=MOE_CONFIG), processes)
    outputs = finish(ranks, 900)
    assert [r.returncode for r in ranks] == [0] * processes, "\n".join(o[-4000:] for o in outputs)
    return read_metrics(output)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "processes", "reference_processes"),
    [
        pytest.param(
            [
                "parallel.expert_model_parallel_size=2",
                "rollout.placement=disaggregated",
                "rollout.engine_ranks=2",
            ],
            4,
            2,
            id="disaggregated-ep2-dp2",
        ),
        pytest.param(
            [
                "parallel.tensor_model_parallel_size=2",
                "parallel.sequence_parallel=true",
                "parallel.expert_tensor_parallel_size=2",
            ],
            2,
            1,
            id="colocated-tp2-sp-etp2",
        ),
    ],
)
def test_expert_layouts_feed_whole_experts_to_the_engines(
    tmp_path, moe_start, layout, processes, reference_processes
):
    """disaggregated-ep2-dp2: two data-parallel replicas, each holding half of the experts, and
    an engine rank per replica; replica 0 sends the weights, the other replica's rank sending its
    experts over the expert-parallel group inside the update. Against the colocated run of two
    replicas holding every expert (two engines sample as one cannot): the same samples exactly,
    so both engines got every expert, and the same updates to float rounding.
    colocated-tp2-sp-etp2: every expert split over two ranks, gathered whole for the engine on
    rank 0, against the one-process run."""
    common = [*moe_start, "train.steps=2"]
    if reference_processes == 1:
        reference = run_in_process(tmp_path / "reference", *common, config=MOE_CONFIG)
    else:
        reference = run_ranks(tmp_path / "reference", common, reference_processes)
    records = run_ranks(tmp_path / "experts", [*common, *layout], processes)
    assert_same_run(records, reference, rollout_steps=2, updates=4)


def test_expert_sets_ignore_missing_ids():
    from bapo_megatron.trainer.router_metrics import expert_sets

    sets = expert_sets(torch.tensor([[[0, 2]], [[-1, -1]]]), 3)
    assert sets.tolist() == [[[True, False, True]], [[False, False, False]]]


def test_routes_travel_from_samples_into_the_batch_and_checkpoints():
    def sample(prompt, tokens, routes):
        return RolloutSample(
            prompt_index=0,
            sample_index=0,
            prompt_token_ids=prompt,
            token_ids=tokens,
            logprobs=[-1.0] * len(tokens),
            versions=[0] * len(tokens),
            finish_reason="stop",
            routes=routes,
        )

    # 1 MoE layer, top-2; 3 + 2 tokens: routes for all but the last sampled one
    first = sample([1, 2, 3], [4, 5], [[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]]])
    second = sample([6, 7], [8], [[[1, 3]], [[0, 2]]])
    batch, _ = to_policy_batch(
        [Group(prompt_id="p", samples=[first, second], rewards=[1.0, 0.0], advantages=[1.0, -1.0])],
        0,
    )
    assert batch.routes.shape == (2, 5, 1, 2)
    assert batch.routes[0, :4].tolist() == first.routes
    assert batch.routes[0, 4].tolist() == [[-1, -1]]  # the last sampled token: routed live
    assert batch.routes[1, :2].tolist() == second.routes
    assert (batch.routes[1, 2:] == -1).all()  # the last sampled token and padding
    assert sample_from_plain(sample_to_plain(first)) == first
    no_routes = sample([1, 2], [3], None)
    assert (
        to_policy_batch(
            [Group(prompt_id="q", samples=[no_routes], rewards=[0.0], advantages=[0.0])], 0
        )[0].routes
        is None
    )
