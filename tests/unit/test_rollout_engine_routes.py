"""Routing replay of the rollout with vLLM and SGLang: the routed experts each engine returns
(shapes and encodings read from vLLM 0.32's and SGLang's sources) decoded into
``RolloutSample.routes``, on fakes of their APIs (the real vLLM on CPU cannot return them: see
docs/moe.md). The layout is the embedded engine's: one row per token the engine ran (prompt
included, the last sampled token excluded), the model's MoE layers only."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import sys
import types

import numpy as np
import pytest

import bapo_megatron.rollout.vllm as vllm_family
from bapo_megatron.actor.routing_replay import validate_routes
from bapo_megatron.config import RolloutConfig, load_config
from bapo_megatron.config.checks import records_routes
from bapo_megatron.data.experience import Group, to_policy_batch
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.rollout.routes import (
    decode_routes,
    routes_from_int32_base64,
    routes_from_npy_base64,
)
from bapo_megatron.rollout.sglang.engine import SGLangEngine, generate_request
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient, parse_completion_response
from tests.helpers.fake_sglang import FakeEngine, FakeServer, sglang_output
from tests.helpers.fake_vllm import (
    FakeLLM,
    FakeLLMEngine,
    FakeVLLMServer,
    vllm_choice,
)
from tests.unit.test_rollout_moe_engine import MODEL as MOE_ENGINE_MODEL

# layer 0 dense, layers 1 and 2 with 4 experts, top-2: the engines' layer axis has 3 columns
MOE = MOE_ENGINE_MODEL


def engine_routes(rows: int, dtype=np.uint8) -> np.ndarray:
    """What an engine returns for ``rows`` tokens: every layer's column, the dense layer's
    holding 200 (out of range: it must be dropped), token r in layer l routed to r + l and
    r + l + 1 (mod 4)."""
    routes = np.full((rows, 3, 2), 200, dtype=dtype)
    for r in range(rows):
        for layer in (1, 2):
            routes[r, layer] = [(r + layer) % 4, (r + layer + 1) % 4]
    return routes


def expected(rows: int) -> list[list[list[int]]]:
    return [[[(r + l) % 4, (r + l + 1) % 4] for l in (1, 2)] for r in range(rows)]  # noqa: E741


def npy_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# ------------------------------------------------------------------ decoding


def test_routes_keep_the_moe_layers_and_are_checked():
    assert decode_routes(engine_routes(4), MOE, tokens=5, finished=True, where="r") == expected(4)
    only_moe = engine_routes(4)[:, 1:].astype(np.int32)  # an engine counting MoE layers only
    assert decode_routes(only_moe, MOE, tokens=5, finished=True, where="r") == expected(4)
    # a cut request: fewer rows are kept (later tokens route live), extra ones dropped
    assert decode_routes(engine_routes(2), MOE, tokens=5, finished=False, where="r") == expected(2)
    assert decode_routes(engine_routes(6), MOE, tokens=5, finished=False, where="r") == expected(4)

    def refused(routes, message, tokens=5):
        with pytest.raises(ValueError, match=message):
            decode_routes(routes, MOE, tokens=tokens, finished=True, where="vLLM request 3")

    refused(engine_routes(3), r"vLLM request 3: routed experts for 3 tokens; the sample ran 4")
    refused(np.zeros((4, 4, 2), np.uint8), "for 4 layers; the model has 3 layers, 2 of them")
    refused(np.zeros((4, 3, 3), np.uint8), "hold 3 experts per token.*num_experts_per_tok=2")
    refused(np.zeros((4, 3), np.uint8), r"integer \[tokens, layers, top_k\], got shape \(4, 3\)")
    refused(np.zeros((4, 3, 2)), "integer .* of float64")
    wrong = engine_routes(4)
    wrong[2, 2] = [1, 4]
    refused(wrong, r"token 2, MoE layer 1: expert id out of range \[0, 4\) \(\[1, 4\]\)")
    wrong[2, 2] = [3, 3]
    refused(wrong, r"token 2, MoE layer 1: the same expert twice \(\[3, 3\]\)")


def test_the_engines_encodings_are_decoded():
    routes = engine_routes(4)
    assert np.array_equal(routes_from_npy_base64(npy_base64(routes), "r"), routes)
    raw = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    assert np.array_equal(routes_from_int32_base64(raw, MOE, "r"), routes)
    only_moe = routes[:2, 1:].astype("<i4")  # 8 ids: not whole tokens of 3 layers x 2
    decoded = routes_from_int32_base64(base64.b64encode(only_moe.tobytes()).decode(), MOE, "r")
    assert np.array_equal(decoded, only_moe)
    with pytest.raises(ValueError, match="r: routed experts are not valid base64"):
        routes_from_npy_base64("not base64!", "r")
    with pytest.raises(ValueError, match="r: routed experts are not an .npy array"):
        routes_from_npy_base64(base64.b64encode(b"12345678").decode(), "r")
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not an .npy array"):  # no pickle is ever loaded
        routes_from_npy_base64(base64.b64encode(pickled.getvalue()).decode(), "r")
    with pytest.raises(ValueError, match="r: routed experts should be a base64 string, got int"):
        routes_from_npy_base64(3, "r")
    with pytest.raises(ValueError, match="7 bytes, not whole int32s"):
        routes_from_int32_base64(base64.b64encode(b"1234567").decode(), MOE, "r")
    with pytest.raises(ValueError, match="5 routed expert ids are not whole tokens"):
        routes_from_int32_base64(base64.b64encode(bytes(20)).decode(), MOE, "r")


# ------------------------------------------------------------------ vLLM in process (fake)


class RoutingLLMEngine(FakeLLMEngine):
    """The fake step loop's vLLM, returning ``routed_experts`` with each finished output, as
    vLLM 0.32 does (context + generated - 1 rows); ``routes`` replaces what it returns."""

    routes = None

    def step(self):
        outputs = super().step()
        prompts = {rid: prompt for rid, prompt, _ in self.added}
        for output in outputs:
            if output.finished:
                rows = len(prompts[output.request_id]) + self.counts[output.request_id] - 1
                routes = engine_routes(rows) if self.routes is None else self.routes(rows)
                output.outputs[0].routed_experts = routes
        return outputs


def routing_llm() -> FakeLLM:
    llm = FakeLLM()
    vllm_config = llm.llm_engine.vllm_config
    llm.llm_engine = RoutingLLMEngine()
    llm.llm_engine.vllm_config = vllm_config
    return llm


@pytest.mark.usefixtures("fake_vllm")
def test_vllm_step_loop_fills_each_samples_routes():
    llm = routing_llm()
    engine = VLLMEngine(llm, MOE, version=0, record_routes=True)
    params = SamplingParams(n=2, max_new_tokens=5, seed=7)
    samples = engine.generate([[1, 2], [3]], params, round_tokens=3)
    assert all(s.finish_reason == "paused" for s in samples)
    assert [s.routes for s in samples] == [expected(4)] * 2 + [expected(3)] * 2
    engine.continue_generation(samples, params)  # the whole context again: routes replaced
    assert [s.routes for s in samples] == [expected(6)] * 2 + [expected(5)] * 2

    # what the actor replays: [samples, tokens, 2 MoE layers, top-2], -1 where none (each
    # sample's last token, padding)
    batch, _ = to_policy_batch([Group("p", samples, [0.0] * 4, [0.0] * 4)], pad_token_id=0)
    validate_routes(batch.routes, MOE)
    assert tuple(batch.routes.shape) == (4, 7, 2, 2)
    assert batch.routes[0, :6].tolist() == expected(6) and (batch.routes[0, 6] == -1).all()
    assert batch.routes[2, :5].tolist() == expected(5) and (batch.routes[2, 5:] == -1).all()

    # cut requests come back without routes: a sample keeps its earlier ones
    [sample] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=6), round_tokens=2)
    assert sample.routes == expected(3)
    cut_at = llm.llm_engine.steps + 1
    llm.llm_engine.on_step = lambda fake: fake.steps == cut_at and engine.pause()
    engine.continue_generation([sample], SamplingParams(max_new_tokens=6))
    assert sample.finish_reason == "paused" and len(sample.token_ids) == 3
    assert sample.routes == expected(3)


@pytest.mark.usefixtures("fake_vllm")
def test_vllm_step_loop_refuses_missing_or_wrong_routes():
    engine = VLLMEngine(FakeLLM(), MOE, version=0, record_routes=True)  # returns no routes
    with pytest.raises(
        ValueError,
        match=r"vLLM request 0 \(prompt 0, sample 0\): no routed experts in the answer; start "
        "vLLM with enable_return_routed_experts=True",
    ):
        engine.generate([[1]], SamplingParams(n=2, max_new_tokens=2))
    llm = routing_llm()
    # the second prompt's request (3 rows) comes back with one expert per token
    llm.llm_engine.routes = lambda rows: engine_routes(rows)[:, :, : 1 if rows == 3 else 2]
    engine = VLLMEngine(llm, MOE, version=0, record_routes=True)
    with pytest.raises(
        ValueError, match=r"vLLM request 1 \(prompt 1, sample 0\): routed experts hold 1 expert"
    ):
        engine.generate([[1], [2, 3]], SamplingParams(max_new_tokens=2))
    dense = dataclasses.replace(MOE, model_type="qwen3", moe=None)
    with pytest.raises(ValueError, match="record_routes: model_type 'qwen3' has no experts"):
        VLLMEngine(FakeLLM(), dense, record_routes=True)


def test_vllm_is_started_with_routed_expert_capture(tmp_path, monkeypatch):
    started = []

    def fake_llm(**options):
        started.append(options)
        return FakeLLM()

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # restored after the test
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=fake_llm))
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)
    monkeypatch.setitem(sys.modules, "vllm.envs", types.SimpleNamespace(disable_envs_cache=list))
    (tmp_path / "config.json").write_text(json.dumps(MOE.to_hf_config()))
    engine = VLLMEngine.from_pretrained(tmp_path, record_routes=True, full_vocab_logprobs=False)
    assert engine.record_routes and started[0]["enable_return_routed_experts"] is True
    engine = VLLMEngine.from_pretrained(tmp_path, full_vocab_logprobs=False)
    assert not engine.record_routes and "enable_return_routed_experts" not in started[1]


def test_runs_ask_vllm_and_sglang_for_routes_under_rollout_replay(monkeypatch, tmp_path):
    overrides = [
        "model.model_type=qwen3_moe",
        "model.num_layers=3",
        "model.hidden_size=64",
        "model.ffn_hidden_size=96",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.vocab_size=128",
        "model.moe.num_experts=4",
        "model.moe.num_experts_per_tok=2",
        "model.moe.moe_intermediate_size=32",
    ]
    for replay, asked in (("rollout", True), ("none", False)):
        cfg = load_config(None, [*overrides, f"algorithm.routing_replay={replay}"])
        assert records_routes(cfg, cfg.model) is asked
    assert not records_routes(cfg, dataclasses.replace(MOE, model_type="qwen3", moe=None))

    started = []
    monkeypatch.setattr(
        vllm_family.VLLMEngine, "from_pretrained", lambda folder, **kw: started.append(kw)
    )
    build_engine(
        RolloutConfig(engine="vllm"),
        MOE,
        model_path="folder",
        dp_rank=0,
        work_dir=tmp_path,
        pad_token_id=0,
        record_routes=True,
    )
    assert started[0]["record_routes"] is True


# ------------------------------------------------------------------ vLLM server (fake)


class RoutingVLLMServer(FakeVLLMServer):
    """Answers each completion with ``routed_experts`` (base64 ``.npy``), as a vLLM 0.32
    server started with ``--enable-return-routed-experts`` does."""

    def __call__(self, method, path, body):
        status, answer = super().__call__(method, path, body)
        if path == "/v1/completions":
            generated = len(answer["choices"][0]["token_ids"])
            rows = len(body["prompt"]) + generated - 1
            answer["choices"][0]["routed_experts"] = npy_base64(engine_routes(rows))
        return status, answer


def test_vllm_server_client_fills_each_samples_routes(tmp_path):
    server = RoutingVLLMServer()
    client = VLLMServerClient.connect(
        "http://fake", MOE, transport=server, weights_dir=tmp_path, record_routes=True
    )
    samples = client.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=4), round_tokens=2)
    assert [s.routes for s in samples] == [expected(4)] * 2
    server.cut_after = 1  # an aborted request: the rows of what it ran
    server.on_complete = client.abort
    samples = client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert samples[0].finish_reason == "abort" and samples[0].routes == expected(3)

    plain = VLLMServerClient.connect(
        "http://fake", MOE, transport=FakeVLLMServer(), record_routes=True
    )
    with pytest.raises(ValueError, match=r"\(prompt 0, sample 0\): .* --enable-return-routed-ex"):
        plain.generate([[1]], SamplingParams(max_new_tokens=2))
    answer = vllm_choice([5], [-0.5])
    answer["choices"][0]["routed_experts"] = "%%%"
    assert parse_completion_response(answer, "out").routes is None  # not asked: not read
    with pytest.raises(ValueError, match=r"out: 'choices\[0\].routed_experts': .* not valid base"):
        parse_completion_response(answer, "out", routes=True)


# ------------------------------------------------------------------ SGLang (fakes)


def sglang_routes(rows: int) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of raw int32, every layer."""
    return base64.b64encode(engine_routes(rows).astype("<i4").tobytes()).decode("ascii")


class RoutingSGLangServer(FakeServer):
    """The fake SGLang server, answering ``return_routed_experts`` requests with routes."""

    def _one(self, ids, sp):
        out = super()._one(ids, sp)
        rows = len(ids) + len(out["output_ids"]) - 1
        out["meta_info"]["routed_experts"] = sglang_routes(rows)
        return out


def test_sglang_requests_and_decodes_routes():
    request_body = generate_request([], SamplingParams(), routes=True)
    assert request_body["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_request([], SamplingParams())

    server = RoutingSGLangServer()
    client = SGLangServerClient(
        "http://fake:30000", MOE, version=0, transport=server, record_routes=True
    )
    samples = client.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=5), round_tokens=2)
    [body] = [body for _, path, body in server.calls if path == "/generate"]
    assert body["return_routed_experts"] is True
    assert [s.routes for s in samples] == [expected(4), expected(2)]
    client.continue_generation(samples, SamplingParams(max_new_tokens=5))
    assert [s.routes for s in samples] == [expected(7), expected(5)]

    plain = SGLangServerClient("http://fake", MOE, version=0, transport=FakeServer())
    [sample] = plain.generate([[1]], SamplingParams(max_new_tokens=2))
    assert sample.routes is None  # not asked for
    plain.record_routes = True
    with pytest.raises(
        ValueError,
        match=r"SGLang request 0 \(prompt 0, sample 0\): no routed experts in the answer; "
        "start SGLang with --enable-return-routed-experts",
    ):
        plain.generate([[1]], SamplingParams(max_new_tokens=2))


def test_sglang_in_process_engine_asks_for_routes():
    fake = FakeEngine()

    def generate(**kwargs):
        fake.calls.append(("generate", kwargs))
        out = sglang_output([9], [-0.5])
        out["meta_info"]["routed_experts"] = engine_routes(len(kwargs["input_ids"][0]))  # array
        return [out]

    fake.generate = generate
    engine = SGLangEngine(fake, MOE, version=0, record_routes=True)
    [sample] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    assert fake.calls[0][1]["return_routed_experts"] is True and "stream" not in fake.calls[0][1]
    assert sample.routes == expected(2)
