"""The trainer's state (paused groups, lag queue, replay buffer) and the RNG states survive a
checkpoint file read with ``torch.load(weights_only=True)`` exactly, and a damaged state is
refused naming the field."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from bapo_megatron.data.experience import Group, ReplayBuffer
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.data.record_fields import ChatMessage
from bapo_megatron.rollout.protocol import RolloutSample
from bapo_megatron.trainer import rng_state
from bapo_megatron.trainer.checkpoint_info import check_same_run
from bapo_megatron.trainer.state import IDENTITY_DEFAULTS, TrainerState


def _sample(index: int, finish: str | None) -> RolloutSample:
    return RolloutSample(
        prompt_index=index,
        sample_index=1,
        prompt_token_ids=[5, 6],
        token_ids=[7, 8, 9],
        logprobs=[-0.1, -2.5e-8, -1 / 3],
        versions=[3, 3, 4],
        finish_reason=finish,
    )


def _group(name: str) -> Group:
    return Group(
        prompt_id=name,
        samples=[_sample(0, "stop"), _sample(1, "length")],
        rewards=[1.0, 0.0],
        advantages=[0.7071067811865476, -0.7071067811865476],
    )


def _state() -> TrainerState:
    replay = ReplayBuffer(capacity=4, max_staleness=2)
    replay.add([_group("r1"), _group("r2")])
    return TrainerState(
        replay=replay,
        step=7,
        version=13,
        position=56,
        paused_groups=[
            (
                PromptRow(id="p3", prompt="1+1", answer="2"),
                [_sample(0, "paused"), _sample(1, "stop")],
            ),
            (  # a row of the verl layout: chat messages, data source and extra information
                PromptRow(
                    id="p4",
                    prompt=(ChatMessage("system", "Be brief."), ChatMessage("user", "2+2")),
                    answer="4",
                    data_source="openai/gsm8k",
                    extra_info={"split": "train", "index": 4, "tags": ["a", None, 1.5]},
                ),
                [_sample(0, "paused")],
            ),
        ],
        lag_queue=[[_group("l1")], []],
        tracker_runs={"wandb": "abc123", "mlflow": "0f1e2d"},
    )


def _through_file(value, tmp_path):
    path = tmp_path / "state.pt"
    torch.save(value, path)
    return torch.load(path, weights_only=True)


def test_trainer_state_round_trips_through_a_weights_only_file(tmp_path):
    state = _state()
    loaded = TrainerState(replay=ReplayBuffer(capacity=4, max_staleness=2))
    loaded.load_checkpoint(_through_file(state.to_checkpoint(), tmp_path), "test file")

    def fields(s: TrainerState) -> tuple:
        return (
            s.step,
            s.version,
            s.position,
            s.paused_groups,
            s.lag_queue,
            s.replay.groups,
            s.tracker_runs,
        )

    assert fields(loaded) == fields(state)
    assert loaded.paused_groups[0][1][0].resumable


def test_damaged_trainer_state_is_refused_naming_the_field():
    fresh = TrainerState(replay=ReplayBuffer(capacity=4, max_staleness=2))
    saved = _state().to_checkpoint()
    with pytest.raises(ValueError, match="f.pt: trainer_state lacks lag_queue"):
        fresh.load_checkpoint({k: v for k, v in saved.items() if k != "lag_queue"}, "f.pt")
    with pytest.raises(ValueError, match=r"f.pt: trainer_state.version is -1"):
        fresh.load_checkpoint(dict(saved, version=-1), "f.pt")
    with pytest.raises(ValueError, match="f.pt: trainer_state's paused groups.*malformed"):
        bad = [{"row": {"id": "x"}, "samples": []}]
        fresh.load_checkpoint(dict(saved, paused_groups=bad), "f.pt")
    with pytest.raises(ValueError, match=r"f.pt: trainer_state.tracker_runs is \['x'\]"):
        fresh.load_checkpoint(dict(saved, tracker_runs=["x"]), "f.pt")
    assert fresh.step == 0 and fresh.paused_groups == [] and fresh.tracker_runs == {}
    # a checkpoint written before the trackers has no record of tracker runs: none to reopen
    fresh.load_checkpoint({k: v for k, v in saved.items() if k != "tracker_runs"}, "f.pt")
    assert fresh.step == 7 and fresh.tracker_runs == {}
    # a checkpoint that names the paused groups by their key's earlier name, "carry"
    older = {("carry" if k == "paused_groups" else k): v for k, v in saved.items()}
    fresh.load_checkpoint(older, "f.pt")
    assert fresh.paused_groups == _state().paused_groups


def test_a_checkpoint_from_before_the_data_keys_belongs_to_a_run_with_the_default_keys():
    from types import SimpleNamespace

    identity = {"train.seed": 0, "data.prompt_key": "prompt", "data.answer_key": "answer"}
    older = SimpleNamespace(run={"train.seed": 0})  # saved before the keys were identifying
    check_same_run(Path("ckpt"), older, identity, IDENTITY_DEFAULTS)
    other = dict(identity, **{"data.answer_key": "reward_model.ground_truth"})
    with pytest.raises(
        ValueError,
        match=r"ckpt belongs to another run: it was saved with data.answer_key='answer' "
        r"\(this run: 'reward_model.ground_truth'\)",
    ):
        check_same_run(Path("ckpt"), older, other, IDENTITY_DEFAULTS)


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path, single_process):
    random.gauss(0, 1)  # Python's and NumPy's cached Gaussians are part of the state
    np.random.standard_normal()
    saved = _through_file(rng_state.capture(), tmp_path)
    want = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2).tolist())
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    rng_state.restore(saved)
    got = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2).tolist())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
