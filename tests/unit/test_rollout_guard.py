"""An engine that fails, dies or stops answering reaches the trainer as an error that names it,
and never hangs it: the guard's deadline aborts a generation that runs too long, and the HTTP
clients give up on a server that is gone or silent."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import ENGINE_KINDS, ModelConfig, RolloutConfig
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.rollout.http import ServerUnreachable, http_transport
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.registry import build_engine, engine_kinds, register_family
from bapo_megatron.rollout.sglang.engine import SGLangEngine
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient

# A context long enough that nothing but the deadline ends the generation below.
ENDLESS = ModelConfig(
    model_type="qwen2",
    num_layers=1,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=64,
    max_position_embeddings=1_000_000,
    tie_word_embeddings=True,
)


def endless_engine() -> EmbeddedEngine:
    engine = EmbeddedEngine(ENDLESS)
    engine.update_weights(
        [(n, p.detach().clone()) for n, p in engine.model.named_parameters()], version=0
    )
    return engine


def test_a_generation_past_its_deadline_is_aborted_and_named():
    guarded = GuardedEngine(endless_engine(), name="engine X", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(
        EngineFailure,
        match=r"^engine X: generate gave no result within 0.5 s "
        r"\(rollout.timeout_s\); the engine was aborted$",
    ):
        guarded.generate([[1, 2]], SamplingParams(max_new_tokens=900_000, seed=0))
    assert time.monotonic() - started < 30  # the abort cut it; uncut it would run for hours


def test_a_generation_within_its_deadline_is_handed_on_and_the_watchdog_stands_down():
    engine = suite.embedded_engine(suite.random_weights(1))
    guarded = GuardedEngine(engine, name="engine Y", timeout_s=600)
    params = SamplingParams(n=2, max_new_tokens=4, seed=5)
    before = set(threading.enumerate())
    first = guarded.generate(suite.PROMPTS, params)
    # the watchdog was cancelled and joined: no thread of it is left to abort a later call
    assert not [t for t in set(threading.enumerate()) - before if isinstance(t, threading.Timer)]
    second = guarded.continue_generation(first, params)
    assert [s.finish_reason for s in second] == ["length"] * 6
    assert [s.token_ids for s in first] == [
        s.token_ids for s in engine.generate(suite.PROMPTS, params)
    ]
    assert guarded.version == 0 and guarded.health()  # everything else is the engine's own


def test_engine_errors_name_the_engine():
    class Dying(EmbeddedEngine):
        def generate(self, prompts, params, *, round_tokens=None):
            raise RuntimeError("EngineCore died unexpectedly")

    engine = Dying(suite.MODEL)
    for timeout in (None, 60.0):
        guarded = GuardedEngine(engine, name="engine Z", timeout_s=timeout)
        with pytest.raises(
            EngineFailure,
            match="^engine Z: generate failed: RuntimeError: EngineCore died unexpectedly$",
        ) as caught:
            guarded.generate([[1]], SamplingParams())
        assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(
        EngineFailure,
        match="^engine Z: update_weights failed: ValueError: "
        "update_weights: 'nope' is not a parameter",
    ):
        guarded.update_weights([("nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        GuardedEngine(engine, name="engine Z", timeout_s=0)


class Broken:
    """An engine whose every protocol method raises, naming the method."""

    version = 3

    def __getattr__(self, method):
        def fail(*args, **kwargs):
            raise OSError(f"{method} hit a dead socket")

        return fail


PROTOCOL_CALLS = {
    "generate": lambda engine: engine.generate([[1]], SamplingParams()),
    "continue_generation": lambda engine: engine.continue_generation([], SamplingParams()),
    "abort": lambda engine: engine.abort(),
    "pause": lambda engine: engine.pause(),
    "resume": lambda engine: engine.resume(),
    "update_weights": lambda engine: engine.update_weights([], version=1),
    "release_memory": lambda engine: engine.release_memory(),
    "resume_memory": lambda engine: engine.resume_memory(),
    "health": lambda engine: engine.health(),
}


@pytest.mark.parametrize("method", sorted(PROTOCOL_CALLS))
def test_every_protocol_method_names_the_engine(method):
    for timeout in (None, 60.0):
        guarded = GuardedEngine(Broken(), name="engine W at http://w:1", timeout_s=timeout)
        with pytest.raises(
            EngineFailure,
            match=rf"^engine W at http://w:1: {method} failed: "
            rf"OSError: {method} hit a dead socket$",
        ) as caught:
            PROTOCOL_CALLS[method](guarded)
        assert isinstance(caught.value.__cause__, OSError)
    assert guarded.version == 3


def test_every_protocol_method_reaches_the_engine():
    engine = suite.embedded_engine(suite.random_weights(2))
    guarded = GuardedEngine(engine, name="engine V")
    weights = suite.random_weights(3)
    assert guarded.update_weights(weights.items(), version=4, checksum=True) == suite.checksum(
        weights.items()
    )
    assert guarded.version == engine.version == 4 and guarded.health()
    guarded.pause()
    [sample] = guarded.generate([[1, 2]], SamplingParams(max_new_tokens=3, seed=0))
    assert sample.finish_reason == "paused" and not sample.token_ids
    guarded.resume()
    guarded.continue_generation([sample], SamplingParams(max_new_tokens=3, seed=0))
    assert sample.finish_reason == "length" and len(sample.token_ids) == 3
    guarded.abort()
    guarded.release_memory()
    assert not guarded.health() and not engine.health()
    guarded.resume_memory()
    assert guarded.version == -1


def test_a_deadline_whose_abort_fails_says_so():
    class Unabortable(EmbeddedEngine):
        def abort(self):
            super().abort()  # still cut the call, then fail as a gone server would
            raise ConnectionRefusedError("abort: connection refused")

    engine = Unabortable(ENDLESS)
    engine.update_weights(
        [(n, p.detach().clone()) for n, p in engine.model.named_parameters()], version=0
    )
    guarded = GuardedEngine(engine, name="engine U", timeout_s=0.5)
    with pytest.raises(
        EngineFailure,
        match=r"^engine U: generate gave no result within 0.5 s "
        r"\(rollout.timeout_s\); aborting the engine failed: "
        r"ConnectionRefusedError: abort: connection refused$",
    ):
        guarded.generate([[1, 2]], SamplingParams(max_new_tokens=900_000, seed=0))


def test_the_registry_knows_every_configurable_kind_and_refuses_others(tmp_path):
    assert set(engine_kinds()) == set(ENGINE_KINDS)
    rollout = RolloutConfig()
    rollout.engine = "tpu-server"  # past the config's own check
    with pytest.raises(
        ValueError,
        match=r"^rollout.engine is 'tpu-server'; the known engine kinds "
        r"are \['embedded', 'vllm', 'vllm-server', 'sglang', "
        r"'sglang-server'\]$",
    ):
        build_engine(
            rollout, suite.MODEL, model_path=None, dp_rank=0, work_dir=tmp_path, pad_token_id=0
        )
    with pytest.raises(ValueError, match=r"kinds \['vllm', 'vllm-server'\] are already registered"):
        register_family("vllm", in_process=print, server_client=print)
    assert len(engine_kinds()) == len(ENGINE_KINDS)


def test_in_process_engines_start_from_the_model_sections_config_on_dummy_weights(
    tmp_path, monkeypatch
):
    """Without train.model_path, vLLM and SGLang start from a folder holding the model section's
    config.json alone, on dummy weights (the trainer's first sync replaces them)."""
    started = {}

    def start(folder, **options):
        started.update(options, folder=folder)
        return EmbeddedEngine(suite.MODEL)

    monkeypatch.setattr(VLLMEngine, "from_pretrained", start)
    monkeypatch.setattr(SGLangEngine, "in_process", start)
    for kind in ("vllm", "sglang"):
        started.clear()
        build_engine(
            RolloutConfig(engine=kind),
            suite.MODEL,
            model_path=None,
            dp_rank=1,
            work_dir=tmp_path,
            pad_token_id=0,
        )
        folder = tmp_path / "engine_start_dp1"
        assert started["folder"] == str(folder) and started["load_format"] == "dummy"
        assert json.loads((folder / "config.json").read_text()) == suite.MODEL.to_hf_config()
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
        started.clear()
        build_engine(
            RolloutConfig(engine=kind),
            suite.MODEL,
            model_path=str(tmp_path / "hf"),
            dp_rank=0,
            work_dir=tmp_path,
            pad_token_id=0,
        )
        assert started["folder"] == str(tmp_path / "hf") and "load_format" not in started


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_server_that_is_gone_is_named_and_reported_unhealthy():
    url = f"http://127.0.0.1:{closed_port()}"
    send = http_transport(url, timeout=5, server="vLLM server")
    with pytest.raises(
        ServerUnreachable,
        match=rf"^vLLM server at {url}: POST /v1/completions failed "
        r"\(.*refused.*\); is the server running\?$",
    ):
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
        with pytest.raises(
            ServerUnreachable,
            match=rf"^SGLang server at {url}: POST /generate got "
            r"no answer within 0.5 s$",
        ):
            send("POST", "/generate", {})
        assert time.monotonic() - started < 10


def test_the_trainers_engine_is_guarded_and_names_its_replica(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    rollout = RolloutConfig(engine="vllm-server", server_urls=("http://a:1", url), timeout_s=5)
    with pytest.raises(
        EngineFailure,
        match=rf"^rollout engine 'vllm-server' of data-parallel replica 1 "
        rf"at {url} could not start: RuntimeError: .*does not answer",
    ):
        build_engine(
            rollout, suite.MODEL, model_path=None, dp_rank=1, work_dir=tmp_path, pad_token_id=0
        )
    engine = build_engine(
        RolloutConfig(timeout_s=2.5),
        suite.MODEL,
        model_path=None,
        dp_rank=0,
        work_dir=tmp_path,
        pad_token_id=0,
    )
    assert isinstance(engine, GuardedEngine) and isinstance(engine.engine, EmbeddedEngine)
    assert (
        engine.timeout_s == 2.5
        and engine.name == "rollout engine 'embedded' of data-parallel replica 0"
    )
    for bad in (0, -1.0):  # ill-typed values are refused by the loader (tests/unit/test_config.py)
        with pytest.raises(ValueError, match="rollout.timeout_s must be a positive number"):
            RolloutConfig(timeout_s=bad)
