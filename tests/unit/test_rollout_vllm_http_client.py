"""The vLLM server client against a fake vLLM server (no vLLM needed): completion requests and
answers, rounds, control and weight routes, and what it refuses."""

import logging
import threading

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.resubmission import EngineOutput
from bapo_megatron.rollout.vllm.server_client import (
    VLLMServerClient,
    completion_request,
    parse_completion_response,
)
from tests.helpers.fake_vllm import (
    FakeVLLMServer,
    vllm_choice,
)
from tests.helpers.vllm_models import (
    request,
)


def test_completion_requests_and_answers():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=20, stop_token_ids=(2,)
    )
    body = completion_request(request(context=(4, 5), cap=6, seed=11), params, "m")
    assert body == {
        "model": "m",
        "prompt": [4, 5],
        "max_tokens": 6,
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "seed": 11,
    }
    assert "seed" not in completion_request(request(), SamplingParams(), "m")
    parsed = parse_completion_response(vllm_choice([30, 31], [-4.5, -4.75], "stop"), "out")
    assert parsed == EngineOutput(token_ids=[30, 31], logprobs=[-4.5, -4.75], finish="stop")
    assert parse_completion_response(vllm_choice([30], [-1.0], ids=False), "out").token_ids == [30]

    def broken(edit):
        answer = vllm_choice([30, 31], [-4.5, -4.75])
        edit(answer["choices"][0])
        return answer

    cases = [
        ({"choices": []}, "expected one entry in 'choices'"),
        (broken(lambda c: c.update(finish_reason=None)), "'choices\\[0\\].finish_reason' is None"),
        (
            broken(lambda c: c.update(logprobs=None)),
            "missing 'choices\\[0\\].logprobs.token_logprobs'",
        ),
        (broken(lambda c: c.update(token_ids=[30])), "has 2 entries for 1 generated tokens"),
        (
            broken(lambda c: c["logprobs"]["token_logprobs"].__setitem__(1, None)),
            r"token_logprobs'\[1\] is None",
        ),
        (
            broken(lambda c: (c.pop("token_ids"), c["logprobs"]["tokens"].__setitem__(0, "hi"))),
            r"'choices\[0\].logprobs.tokens'\[0\] is 'hi'",
        ),
    ]
    for answer, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_completion_response(answer, "out")


def test_server_client_rounds_control_and_weights(tmp_path, caplog):
    server = FakeVLLMServer()
    client = VLLMServerClient.connect(
        "http://fake", suite.MODEL, transport=server, weights_dir=tmp_path
    )
    assert client.served_model == "served" and client.server_device == "cpu"
    assert client.server_chunked_prefill is False
    assert server.paths() == ["/health", "/v1/models"] + ["/collective_rpc"] * 3
    params = SamplingParams(n=3, max_new_tokens=5, seed=1)
    samples = client.generate([[1, 2]], params, round_tokens=2)
    completions = [body for _, path, body in server.calls if path == "/v1/completions"]
    assert len(completions) == 3 and len({body["seed"] for body in completions}) == 3
    assert all(s.finish_reason == "paused" and s.token_ids == [100, 101] for s in samples)

    weights = suite.random_weights(0)
    digest = client.update_weights(weights.items(), version=1, checksum=True)
    assert digest == suite.checksum(weights.items())
    assert sorted(server.loaded) == sorted(weights) and torch.equal(
        server.loaded["model.norm.weight"], weights["model.norm.weight"]
    )
    first_folder = next(tmp_path.iterdir())
    assert server.paths()[-1] == "/reset_prefix_cache"
    client.update_weights(weights.items(), version=2)
    assert [p.name for p in tmp_path.iterdir()] != [first_folder.name]  # the old folder is gone
    assert len(list(tmp_path.iterdir())) == 1

    client.continue_generation(samples, params)
    assert all(s.versions == [0, 0, 2, 2, 2] and s.finish_reason == "length" for s in samples)

    server.cut_after, server.on_complete = 1, client.pause
    samples = client.generate([[1]], params)
    assert (
        samples[0].finish_reason == "paused" and ("POST", "/pause?mode=abort", None) in server.calls
    )
    client.resume()
    # A request that reaches a paused server is held until an abort: the client keeps aborting.
    server.cut_after, server.on_complete = None, None
    server.hold = threading.Event()
    threading.Timer(0.2, client.pause).start()
    samples = client.generate([[1]], params)
    assert samples[0].finish_reason == "paused" and samples[0].token_ids == []
    assert server.paths().count("/abort_requests") >= 1
    server.hold = None
    client.resume()
    server.cut_after, server.on_complete = 1, client.abort
    assert client.generate([[1]], params)[0].finish_reason == "abort"
    assert ("POST", "/abort_requests", {}) in server.calls

    with caplog.at_level(logging.WARNING):
        client.release_memory()
        client.resume_memory()
    assert "runs on CPU" in caplog.text and "/sleep?level=1" not in server.paths()
    assert client.version == -1 and not client.health()
    server.device = "cuda"
    client.server_device = "cuda"
    client.release_memory()
    client.resume_memory()
    assert server.paths()[-2:] == ["/sleep?level=1", "/wake_up"]


def test_server_client_refuses_seeds_on_a_cpu_server_that_prefills_in_chunks():
    server = FakeVLLMServer()
    server.chunked_prefill = True
    client = VLLMServerClient.connect("http://fake", suite.MODEL, transport=server)
    assert client.server_chunked_prefill is True
    with pytest.raises(
        ValueError, match="sampling.seed: the vLLM server at http://fake runs on CPU"
    ):
        client.generate([[1]], SamplingParams(max_new_tokens=2, seed=4))
    assert "/v1/completions" not in server.paths()
    assert client.generate([[1]], SamplingParams(max_new_tokens=2))[0].token_ids == [100, 101]
    client.server_device = "cuda"  # GPU generators rewind: chunked prefill is fine there
    client.generate([[1]], SamplingParams(max_new_tokens=2, seed=4))
    server.chunked_prefill = "False"  # what /collective_rpc makes of a bare bool
    with pytest.raises(RuntimeError, match="expected results.0..enable_chunked_prefill true"):
        VLLMServerClient.connect("http://fake", suite.MODEL, transport=server)


def test_server_client_refuses_what_it_cannot_do(tmp_path):
    server = FakeVLLMServer()
    client = VLLMServerClient(
        "http://fake", suite.MODEL, served_model="m", transport=server, full_vocab_logprobs=False
    )
    with pytest.raises(ValueError, match="sampling.top_k/top_p truncate"):
        client.generate([[1]], SamplingParams(top_k=3))
    with pytest.raises(ValueError, match="update_weights needs weights_dir"):
        client.update_weights([], version=1)
    client.weights_dir = tmp_path
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        client.update_weights([("model.nope.weight", torch.zeros(1))], version=1)
    assert not list(tmp_path.iterdir()) and client.version == 0

    def server_error(method, path, body):
        return 400, {"error": "no such method"}

    with pytest.raises(RuntimeError, match="could not install the full-vocabulary log-prob hook"):
        VLLMServerClient.connect(
            "http://fake",
            suite.MODEL,
            served_model="m",
            transport=lambda m, p, b: (200, None) if p == "/health" else server_error(m, p, b),
        )
