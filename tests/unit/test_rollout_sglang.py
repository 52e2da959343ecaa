"""The SGLang server client, without SGLang (it cannot run on these machines): request building,
parsing of responses in SGLang's documented format, and the client's bookkeeping (partial
rollout, pause/abort, weight updates, memory) against a fake server. The in-process engine:
test_rollout_sglang_in_process.py."""

from __future__ import annotations

import types

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.rollout.checksum import checksum
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.resubmission import (
    EngineOutput,
    RoundRequest,
)
from bapo_megatron.rollout.sglang.engine import (
    check_update_result,
    generate_request,
    parse_generate_response,
    sampling_params_of,
    weight_buckets,
)
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient, tensor_update_request
from tests.helpers.fake_sglang import FakeServer, sglang_output
from tests.unit.test_rollout_resubmission import sample


def test_sampling_params_follow_sglangs_names():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=9, seed=1)
    request = RoundRequest(sample=sample(), context=[1, 2], max_new_tokens=4, final=False, seed=77)
    body = sampling_params_of(request, params)
    assert body == {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "n": 1,
        "stop_token_ids": [],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 77,
    }
    # SGLang's ignore_eos also ignores stop_token_ids: with stop tokens it must stay off.
    stopping = sampling_params_of(request, SamplingParams(top_k=5, stop_token_ids=(2, 3)))
    assert stopping["ignore_eos"] is False and stopping["stop_token_ids"] == [2, 3]
    assert stopping["top_k"] == 5
    unseeded = RoundRequest(sample=sample(), context=[1], max_new_tokens=1, final=True, seed=None)
    assert "sampling_seed" not in sampling_params_of(unseeded, params)
    full = generate_request([request, unseeded], params)
    assert full["input_ids"] == [[1, 2], [1]] and full["return_logprob"] is True
    assert len(full["sampling_params"]) == 2 and full["stream"] is False


def test_generate_responses_are_parsed_and_checked():
    # hand-written from SGLang's documented /generate answer (never recorded from a server)
    written_from_docs = [
        sglang_output([5, 9, 2], [-0.25, -1.5, -0.125], "stop", matched=2),
        sglang_output([7], [-3.0], "abort", ids=False, message="Abort before prefill"),
    ]
    first, second = parse_generate_response(written_from_docs, 2)
    assert first == EngineOutput(token_ids=[5, 9, 2], logprobs=[-0.25, -1.5, -0.125], finish="stop")
    assert second.finish == "abort" and second.token_ids == [7]
    assert second.detail == "Abort before prefill"
    [single] = parse_generate_response(sglang_output([1], [-1.0]), 1)  # a lone dict
    assert single.token_ids == [1]

    def broken(edit):
        out = sglang_output([5, 9], [-0.25, -1.5])
        edit(out)
        return [out]

    cases = [
        (broken(lambda o: o.pop("meta_info")), r"/generate\[0\]: missing 'meta_info'"),
        (
            broken(lambda o: o["meta_info"].pop("output_token_logprobs")),
            "missing 'meta_info.output_token_logprobs'",
        ),
        (
            broken(lambda o: o["meta_info"].update(finish_reason=None)),
            "'meta_info.finish_reason' is None",
        ),
        (
            broken(lambda o: o["meta_info"].update(finish_reason={"type": "eos"})),
            "'type' is 'stop'",
        ),
        (broken(lambda o: o.update(output_ids=[5])), "'output_ids' holds 1 tokens"),
        (broken(lambda o: o.update(output_ids=[5, 8])), r"'output_ids'\[1\] = 8 but"),
        (
            broken(
                lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(1, [None, 9, None])
            ),
            r"'meta_info.output_token_logprobs'\[1\]",
        ),
        (
            broken(lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(0, 0.5)),
            r"'meta_info.output_token_logprobs'\[0\] is 0.5",
        ),
    ]
    for response, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_generate_response(response, 1)
    with pytest.raises(ValueError, match="expected a list of 2 outputs, got a list of 1"):
        parse_generate_response([sglang_output([1], [-1.0])], 2)


def test_update_results_and_buckets():
    for ok in (None, (True, "ok"), {"success": True}, types.SimpleNamespace(success=True)):
        check_update_result(ok, "x")
    for failed in (
        (False, "shape mismatch"),
        {"success": False, "message": "shape mismatch"},
        types.SimpleNamespace(success=False, message="shape mismatch"),
    ):
        with pytest.raises(RuntimeError, match="SGLang x failed: shape mismatch"):
            check_update_result(failed, "x")
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([4, 4, 10, 1])]  # float32: 4 B each
    assert [[n for n, _ in b] for b in weight_buckets(tensors, 32)] == [
        ["t0", "t1"],
        ["t2"],
        ["t3"],
    ]


def test_weight_route_body():
    assert tensor_update_request("abc", tp_size=2, flush_cache=False, weight_version="3") == {
        "serialized_named_tensors": ["abc", "abc"],
        "load_format": None,
        "flush_cache": False,
        "weight_version": "3",
    }


# ------------------------------------------------------------ the server client on a fake server


@pytest.fixture
def server():
    return FakeServer()


@pytest.fixture
def engine(server):
    return SGLangServerClient(
        "http://fake:30000",
        suite.MODEL,
        version=0,
        transport=server,
        serialize=lambda named: ",".join(n for n, _ in named),
        bucket_bytes=64 * 1024,
    )


def test_partial_rollout_over_http(server, engine):
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    samples = engine.generate([[1, 2, 3], [4]], params, round_tokens=2)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s.finish_reason == "paused" for s in samples)
    assert samples[0].token_ids == [103, 104] and samples[2].token_ids == [101, 102]
    assert samples[0].logprobs == pytest.approx([-1.03, -1.04])
    engine.update_weights(suite.random_weights(0).items(), version=1)
    engine.continue_generation(samples, params)
    _, _, body = server.calls[-1]
    assert body["input_ids"][0] == [1, 2, 3, 103, 104]
    assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [3] * 4
    for s in samples:
        assert s.finish_reason == "length" and s.versions == [0, 0, 1, 1, 1]
    assert samples[0].token_ids == [103, 104, 105, 106, 107]


def test_stop_tokens_end_samples(server, engine):
    [s] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=9, stop_token_ids=(104,)))
    assert s.finish_reason == "stop" and s.token_ids == [102, 103, 104]


def test_pause_and_abort_over_http(server, engine):
    params = SamplingParams(max_new_tokens=50)
    server.cut_after = 3
    server.on_generate = engine.pause  # as if pause() came from another thread meanwhile
    samples = engine.generate([[1], [2, 3]], params)
    assert [s.finish_reason for s in samples] == ["paused", "paused"]
    assert ("POST", "/pause_generation", {"mode": "abort"}) in server.calls
    generated = len(server.calls)
    engine.continue_generation(samples, params)  # paused: nothing is sent
    assert len(server.calls) == generated and all(s.finish_reason == "paused" for s in samples)
    engine.resume()
    assert server.calls[-1] == ("POST", "/continue_generation", {})

    server.on_generate = engine.abort
    engine.continue_generation(samples, params)
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    assert samples[0].token_ids == [101, 102, 103, 104, 105, 106]
    assert ("POST", "/abort_request", {"rid": "", "abort_all": True}) in server.calls

    server.on_generate = None  # an abort nobody asked for is SGLang's own error
    with pytest.raises(RuntimeError, match="SGLang request 0 was aborted by the engine"):
        engine.generate([[1]], params)


def test_weight_updates_over_http(server, engine):
    weights = suite.random_weights(1)
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))], version=1)
    assert "/update_weights_from_tensor" not in server.paths() and engine.version == 0
    digest = engine.update_weights(weights.items(), version=2, checksum=True)
    assert digest == checksum(weights.items()) and engine.version == 2
    updates = [body for _, path, body in server.calls if path == "/update_weights_from_tensor"]
    assert len(updates) > 1  # 64 KiB buckets
    sent = ",".join(body["serialized_named_tensors"][0] for body in updates).split(",")
    assert sent == list(weights) and not any(body["flush_cache"] for body in updates)
    assert server.paths()[-1] == "/flush_cache"

    engine.weight_update_session = True
    engine.update_weights(list(weights.items())[:1], version=3)
    assert server.paths()[-4:] == [
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/flush_cache",
    ]
    server.status["/update_weights_from_tensor"] = 400
    with pytest.raises(RuntimeError, match="update_weights_from_tensor answered 400"):
        engine.update_weights(weights.items(), version=4)
    assert engine.version == 3 and server.paths()[-1] == "/end_weight_update"


def test_memory_and_health_over_http(server, engine):
    assert engine.health()
    engine.release_memory()
    assert not engine.health() and server.paths()[-1] == "/release_memory_occupation"
    with pytest.raises(RuntimeError, match="release_memory"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(RuntimeError, match="release_memory"):
        engine.update_weights([], version=1)
    engine.resume_memory()
    assert server.paths()[-1] == "/resume_memory_occupation"
    with pytest.raises(RuntimeError, match="before a complete update_weights"):
        engine.generate([[1]], SamplingParams())
    engine.update_weights(suite.random_weights(2).items(), version=5)
    assert engine.health()
    server.status["/health"] = 503
    assert not engine.health()


def test_a_server_client_starts_without_weights_and_names_its_server(server):
    client = SGLangServerClient("http://fake", suite.MODEL, transport=server)
    assert client.version == -1 and not client.health() and client.tp_size == 1
    server.status["/flush_cache"] = 400
    with pytest.raises(
        RuntimeError, match=r"^SGLang at http://fake POST /flush_cache answered 400"
    ):
        client.update_weights([], version=0)
    assert client.version == -1
