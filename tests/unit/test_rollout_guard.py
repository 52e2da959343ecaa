"""An engine that fails, dies or stops answering reaches the trainer as an error that names it,
and never hangs it: the guard's deadline aborts a generation that runs too long, and the HTTP
clients give up on a server that is gone or silent."""

from __future__ import annotations

import socket
import time

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import ModelConfig, RolloutConfig
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.rollout.http import ServerUnreachable, http_transport
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient

# A context long enough that nothing but the deadline ends the generation below.
ENDLESS = ModelConfig(model_type="qwen2", num_layers=1, hidden_size=32, ffn_hidden_size=64,
                      num_attention_heads=2, num_query_groups=1, vocab_size=64,
                      max_position_embeddings=1_000_000, tie_word_embeddings=True)


def endless_engine() -> EmbeddedEngine:
    engine = EmbeddedEngine(ENDLESS)
    engine.update_weights([(n, p.detach().clone()) for n, p in engine.model.named_parameters()], version=0)
    return engine


def test_a_generation_past_its_deadline_is_aborted_and_named():
    guarded = GuardedEngine(endless_engine(), name="engine X", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(EngineFailure, match=r"^engine X: generate gave no result within 0.5 s "
                                            r"\(rollout.timeout_s\); the engine was aborted$"):
        guarded.generate([[1, 2]], SamplingParams(max_new_tokens=900_000, seed=0))
    assert time.monotonic() - started < 30  # the abort cut it; uncut it would run for hours


def test_a_generation_within_its_deadline_is_handed_on_and_the_watchdog_stands_down():
    engine = suite.embedded_engine(suite.random_weights(1))
    guarded = GuardedEngine(engine, name="engine Y", timeout_s=0.3)
    params = SamplingParams(n=2, max_new_tokens=4, seed=5)
    first = guarded.generate(suite.PROMPTS, params)
    time.sleep(0.5)  # a watchdog left running would abort the next call
    second = guarded.continue_generation(first, params)
    assert [s.finish_reason for s in second] == ["length"] * 6
    assert [s.token_ids for s in first] == [s.token_ids for s in engine.generate(suite.PROMPTS, params)]
    assert guarded.version == 0 and guarded.health()  # everything else is the engine's own


def test_engine_errors_name_the_engine():
    class Dying(EmbeddedEngine):
        def generate(self, prompts, params, *, round_tokens=None):
            raise RuntimeError("EngineCore died unexpectedly")

    engine = Dying(suite.MODEL)
    for timeout in (None, 60.0):
        guarded = GuardedEngine(engine, name="engine Z", timeout_s=timeout)
        with pytest.raises(EngineFailure, match="^engine Z: generate failed: RuntimeError: "
                                                "EngineCore died unexpectedly$") as caught:
            guarded.generate([[1]], SamplingParams())
        assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(EngineFailure, match="^engine Z: update_weights failed: ValueError: "
                                            "update_weights: 'nope' is not a parameter"):
        guarded.update_weights([("nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        GuardedEngine(engine, name="engine Z", timeout_s=0)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_server_that_is_gone_is_named_and_reported_unhealthy():
    url = f"http://127.0.0.1:{closed_port()}"
    send = http_transport(url, timeout=5, server="vLLM server")
    with pytest.raises(ServerUnreachable, match=rf"^vLLM server at {url}: POST /v1/completions failed "
                                                r"\(.*refused.*\); is the server running\?$"):
        send("POST", "/v1/completions", {"prompt": [1]})
    client = VLLMServerClient(url, suite.MODEL, served_model="m", version=0, timeout=5)
    assert not client.health()
    with pytest.raises(ServerUnreachable, match=rf"vLLM server at {url}: POST /v1/completions"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_a_silent_server_times_out_naming_it():
    with socket.socket() as listener:  # accepts connections (the backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        send = http_transport(url, timeout=0.5, server="SGLang server")
        started = time.monotonic()
        with pytest.raises(ServerUnreachable, match=rf"^SGLang server at {url}: POST /generate got "
                                                    r"no answer within 0.5 s$"):
            send("POST", "/generate", {})
        assert time.monotonic() - started < 10


def test_the_trainers_engine_is_guarded_and_names_its_replica(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    rollout = RolloutConfig(engine="vllm-server", server_urls=("http://a:1", url), timeout_s=5)
    with pytest.raises(EngineFailure, match=rf"^rollout engine 'vllm-server' of data-parallel replica 1 "
                                            rf"at {url} could not start: RuntimeError: .*does not answer"):
        build_engine(rollout, suite.MODEL, model_path=None, dp_rank=1, work_dir=tmp_path, pad_token_id=0)
    engine = build_engine(RolloutConfig(timeout_s=2.5), suite.MODEL, model_path=None, dp_rank=0,
                          work_dir=tmp_path, pad_token_id=0)
    assert isinstance(engine, GuardedEngine) and isinstance(engine.engine, EmbeddedEngine)
    assert engine.timeout_s == 2.5 and engine.name == "rollout engine 'embedded' of data-parallel replica 0"
    for bad in (0, -1.0, "soon", True):
        with pytest.raises(ValueError, match="rollout.timeout_s must be a positive number"):
            RolloutConfig(timeout_s=bad)
