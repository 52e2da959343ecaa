"""The SGLang in-process engine against a fake ``sglang.Engine`` (SGLang cannot run on these
machines): the documented engine API it calls, weight sessions, health, and where it starts its
workers."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import RolloutConfig
from bapo_megatron.rollout import sglang as sglang_family
from bapo_megatron.rollout.engine_setup import EngineSetup
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.sglang.engine import (
    SGLangEngine,
)
from tests.helpers.fake_sglang import FakeEngine


@pytest.fixture
def fake_io_struct(monkeypatch):
    """The two request classes the in-process engine imports from SGLang."""
    module = types.ModuleType("sglang.srt.managers.io_struct")
    module.PauseGenerationReqInput = lambda mode="abort": types.SimpleNamespace(mode=mode)
    module.ContinueGenerationReqInput = types.SimpleNamespace
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", module)


def test_in_process_engine_calls_the_documented_engine_api(fake_io_struct):
    fake = FakeEngine()
    engine = SGLangEngine(fake, suite.MODEL, version=0)
    [s] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=1, seed=1))
    assert s.token_ids == [9] and s.finish_reason == "length"
    name, kwargs = fake.calls[0]
    assert (
        name == "generate" and kwargs["input_ids"] == [[1, 2]] and kwargs["return_logprob"] is True
    )
    assert kwargs["sampling_params"][0]["max_new_tokens"] == 1
    engine.update_weights(suite.random_weights(3).items(), version=1)
    updates = [kw for name, kw in fake.calls if name == "update_weights_from_tensor"]
    assert updates and all(kw["load_format"] is None and not kw["flush_cache"] for kw in updates)
    assert fake.calls[-1][0] == "flush_cache"
    engine.abort()
    engine.pause()
    engine.resume()
    assert ("abort_request", {"abort_all": True}) in fake.calls
    assert ("pause_generation", "abort") in fake.calls and (
        "continue_generation",
        None,
    ) in fake.calls
    engine.release_memory()
    engine.resume_memory()
    assert [name for name, _ in fake.calls[-2:]] == [
        "release_memory_occupation",
        "resume_memory_occupation",
    ]


def test_in_process_weight_sessions_and_health(fake_io_struct, caplog):
    fake = FakeEngine()
    engine = SGLangEngine(fake, suite.MODEL, version=0, weight_update_session=True)
    assert engine.health()
    with pytest.raises(
        RuntimeError, match="SGLang end_weight_update failed: packed weights incomplete"
    ):
        engine.update_weights(list(suite.random_weights(3).items())[:1], version=1)
    assert [name for name, _ in fake.calls] == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
    ]
    assert engine.version == 0  # nothing flushed, version kept
    fake.healthy = False
    assert not engine.health() and "SGLang engine health check failed" in caplog.text


def test_in_process_needs_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="needs the optional package sglang"):
        SGLangEngine.in_process("/nowhere")


@pytest.mark.parametrize(
    ("device", "want"),
    [("cuda", {"base_gpu_id": 4}), ("cuda:4", {"base_gpu_id": 4}), ("cpu", {})],
)
def test_in_process_sglang_starts_its_workers_at_its_ranks_gpu(monkeypatch, tmp_path, device, want):
    """Two replicas of a node (first ranks at local GPUs 0 and 4) must not both start SGLang's
    workers at GPU 0, SGLang's default."""
    seen = {}

    def in_process(cls, model_path, **kwargs):
        seen.update(kwargs)
        return "engine"

    monkeypatch.setattr(SGLangEngine, "in_process", classmethod(in_process))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 4)
    setup = EngineSetup(
        rollout=RolloutConfig(engine="sglang", engine_tensor_parallel_size=4),
        model=suite.MODEL,
        model_path=str(tmp_path),
        url=None,
        dp_rank=1,
        work_dir=tmp_path,
        pad_token_id=0,
        device=device,
    )
    assert sglang_family.start_in_process(setup) == "engine"
    assert seen["tp_size"] == 4
    assert {k: v for k, v in seen.items() if k == "base_gpu_id"} == want
