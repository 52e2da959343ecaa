"""The loop's engine calls around training (``rollout.release_memory_during_training``) go
through the agree-on-failure helper: an engine that fails there surfaces as EngineFailure
naming the call and the error (on every rank), like a failure during generation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bapo_megatron.distributed.watchdog import PhaseWatchdog
from bapo_megatron.rollout.guard import EngineFailure
from bapo_megatron.trainer.loop import sync_weights, train_minibatches
from bapo_megatron.trainer.tracking import PhaseTimer


class _Engine:
    """An engine whose ``failing`` memory call raises; records the calls it got."""

    def __init__(self, failing: str) -> None:
        self.failing, self.calls = failing, []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.failing:
            raise RuntimeError(f"{name} ran out of device memory")

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")


def _run(engine, context, release: bool = True, old_logprobs: str = "engine", epochs: int = 1):
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(release_memory_during_training=release),
        algorithm=SimpleNamespace(
            epochs=epochs,
            max_staleness=0,
            old_logprobs=old_logprobs,
            optimizer_steps_per_rollout=3,
            kl=None,
        ),
        loss=None,
    )
    return SimpleNamespace(
        cfg=cfg,
        engine=engine,
        context=context,
        timer=PhaseTimer(),
        state=SimpleNamespace(version=0, step=3),
        watchdog=PhaseWatchdog(None, 0, 1, stall_s=60),
        actor=None,
        plan=None,
        summary=None,
        logger=SimpleNamespace(log=lambda *args, **kwargs: None),
    )


def test_failed_memory_release_stops_with_engine_failure(single_process):
    engine = _Engine("release_memory")
    with pytest.raises(
        EngineFailure,
        match=r"engine\.release_memory\(\) before training at "
        r"rollout step 3: rank 0: RuntimeError: "
        r"release_memory ran out of device memory",
    ):
        train_minibatches(_run(engine, single_process), [], step=3)
    assert engine.calls == ["release_memory"]


def test_failed_memory_resume_stops_with_engine_failure(single_process):
    engine = _Engine("resume_memory")
    with pytest.raises(
        EngineFailure,
        match=r"engine\.resume_memory\(\) after training at "
        r"rollout step 4: rank 0: RuntimeError",
    ):
        sync_weights(_run(engine, single_process), start_version=0, step=4)
    assert engine.calls == ["resume_memory"]


def test_engine_memory_is_left_alone_without_the_setting(single_process):
    engine = _Engine("release_memory")
    assert train_minibatches(_run(engine, single_process, release=False), [], step=0) == ({}, 0.0)
    assert engine.calls == []


@pytest.mark.parametrize("old_logprobs", ["recompute", "engine"])
def test_only_the_first_update_after_recomputed_logprobs_is_told_its_ratios_are_one(
    single_process, monkeypatch, old_logprobs
):
    """Recomputed old log-probs are the current weights' until the first optimizer step: that
    update alone may skip granularity `step`'s forward pass; engine log-probs never."""
    import torch

    from bapo_megatron.trainer import loop

    flags = []

    def fake_train_step(actor, batch, loss, plan, *, ratios_are_one, kl):
        flags.append(ratios_are_one)
        return {"response_tokens": 1.0}

    monkeypatch.setattr(loop, "train_step", fake_train_step)
    run = _run(None, single_process, release=False, old_logprobs=old_logprobs, epochs=2)
    minibatches = [(None, torch.zeros(1, 2, dtype=torch.long)) for _ in range(3)]
    train_minibatches(run, minibatches, step=0)
    assert flags == [old_logprobs == "recompute"] + [False] * 5
    assert run.state.version == 6
