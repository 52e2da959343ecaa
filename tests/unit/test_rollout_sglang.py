"""The SGLang in-process engine and server client, without SGLang (it cannot run on these
machines): request building, parsing of responses in SGLang's documented format, and the
adapters' bookkeeping (partial rollout, pause/abort, weight updates, memory) against a fake
server and a fake in-process engine. Also the pieces the vLLM and SGLang adapters share
(:mod:`bapo_megatron.rollout.resubmission`), and that none of the adapter modules imports an engine
package at import time."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import RolloutConfig
from bapo_megatron.rollout import sglang as sglang_family
from bapo_megatron.rollout.checksum import checksum
from bapo_megatron.rollout.engine_setup import EngineSetup
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams
from bapo_megatron.rollout.resubmission import (
    EngineOutput,
    RoundRequest,
    apply_output,
    plan_round,
    sample_seed,
    wait_cutting,
)
from bapo_megatron.rollout.sglang.engine import (
    SGLangEngine,
    check_update_result,
    generate_request,
    parse_generate_response,
    sampling_params_of,
    weight_buckets,
)
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient, tensor_update_request


def test_adapters_import_without_engine_packages():
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['sglang'] = None\n"
        "import bapo_megatron.rollout.vllm.engine, bapo_megatron.rollout.vllm.server_client\n"
        "import bapo_megatron.rollout.vllm.worker_extension\n"
        "import bapo_megatron.rollout.sglang.engine, bapo_megatron.rollout.sglang.server_client\n"
        "from bapo_megatron.rollout.registry import engine_kinds\n"
        "assert len(engine_kinds()) == 5, engine_kinds()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ shared pieces


def sample(tokens=(), prompt=(1, 2)) -> RolloutSample:
    s = RolloutSample(prompt_index=0, sample_index=0, prompt_token_ids=list(prompt))
    s.token_ids, s.logprobs, s.versions = list(tokens), [-1.0] * len(tokens), [0] * len(tokens)
    return s


def test_rounds_resubmit_prompt_plus_tokens_with_the_rest_of_the_budget():
    params = SamplingParams(max_new_tokens=10, seed=4)
    fresh, half = sample(), sample(tokens=(7, 8, 9, 10, 11, 12, 13, 14))
    first, second = plan_round([fresh, half], params, round_tokens=3)
    assert first.context == [1, 2] and first.max_new_tokens == 3 and not first.final
    assert second.context == [1, 2, 7, 8, 9, 10, 11, 12, 13, 14]
    assert second.max_new_tokens == 2 and second.final
    assert first.seed != second.seed and first.seed == sample_seed(4, fresh)
    assert sample_seed(None, fresh) is None and 0 <= sample_seed(2**40, fresh) < 2**31
    with pytest.raises(ValueError, match="round_tokens must be a positive integer"):
        plan_round([fresh], params, round_tokens=0)
    with pytest.raises(ValueError, match="already generated max_new_tokens"):
        plan_round([sample(tokens=range(10))], params, None)


def test_outputs_append_with_the_current_version_and_map_finish_reasons():
    def run(finish, n_tokens, *, cap=3, final=False, pausing=False):
        s = sample(tokens=(5,))
        request = RoundRequest(
            sample=s, context=[1, 2, 5], max_new_tokens=cap, final=final, seed=None
        )
        apply_output(
            request,
            EngineOutput(
                token_ids=list(range(n_tokens)), logprobs=[-0.5] * n_tokens, finish=finish
            ),
            version=4,
            pausing=pausing,
            where="out",
        )
        return s

    s = run("length", 3)
    assert (
        s.finish_reason == "paused" and s.token_ids == [5, 0, 1, 2] and s.versions == [0, 4, 4, 4]
    )
    assert run("length", 3, final=True).finish_reason == "length"
    assert run("length", 2).finish_reason == "length"  # below the cap: the context window
    assert run("stop", 2).finish_reason == "stop"
    assert run("abort", 1).finish_reason == "abort"
    assert run("abort", 1, pausing=True).finish_reason == "paused"
    request = RoundRequest(sample=sample(), context=[1], max_new_tokens=2, final=True, seed=None)
    bad = [
        (EngineOutput([1, 2], [-1.0], "length"), "'logprobs' has 1 entries for 2"),
        (
            EngineOutput([1, 2, 3], [-1.0] * 3, "length"),
            "'token_ids' holds 3 tokens, the request allowed 2",
        ),
        (
            EngineOutput([1], [float("nan")], "stop"),
            r"'logprobs'\[0\] = nan is not a log-probability",
        ),
        (EngineOutput([1], [0.5], "stop"), r"'logprobs'\[0\] = 0.5"),
        (EngineOutput([], [], "stop"), "'stop' with no generated token"),
    ]
    for output, message in bad:
        with pytest.raises(ValueError, match=message):
            apply_output(request, output, version=0, pausing=False, where="out")


def test_a_cut_round_keeps_aborting_until_every_request_is_back():
    released = threading.Event()
    aborts = []

    def abort_all():  # the held request returns only after the second abort
        aborts.append(time.monotonic())
        if len(aborts) == 2:
            released.set()

    with ThreadPoolExecutor(max_workers=2) as pool:
        quick = pool.submit(lambda: "quick")
        held = pool.submit(lambda: released.wait(10) and "held")
        assert wait_cutting([quick, held], lambda: True, abort_all, interval=0.01) == [
            "quick",
            "held",
        ]
    assert len(aborts) == 2
    with ThreadPoolExecutor(max_workers=1) as pool:  # not cut: never aborts
        assert wait_cutting([pool.submit(lambda: 1)], lambda: False, abort_all, interval=0.01) == [
            1
        ]
    assert len(aborts) == 2


# ------------------------------------------------------------------ requests and responses


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


def sglang_output(tokens, logprobs, finish="length", *, ids=True, **finish_extra):
    """One ``/generate`` output as SGLang 0.5.x documents it (``skip_tokenizer_init``)."""
    out = {
        "text": "",
        "meta_info": {
            "id": "4f2c",
            "finish_reason": {"type": finish, **finish_extra},
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens)],
        },
    }
    if ids:
        out["output_ids"] = list(tokens)
    return out


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


class FakeServer:
    """Answers like an SGLang server: each generated token is ``100 + position in the context``
    with log-prob ``-0.01 * token``. ``cut_after`` makes every request of the next
    ``/generate`` stop after that many tokens with finish ``abort`` (as after an abort or a
    pause); ``on_generate`` runs before it answers."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict | None]] = []
        self.cut_after: int | None = None
        self.on_generate = None
        self.status: dict[str, int] = {}

    def __call__(self, method, path, body):
        self.calls.append((method, path, body))
        if path in self.status:
            return self.status[path], {"success": False, "message": "no"}
        if path == "/generate":
            if self.on_generate:
                self.on_generate()
            return 200, [
                self._one(ids, sp) for ids, sp in zip(body["input_ids"], body["sampling_params"])
            ]
        if path == "/health":
            return 200, None
        return 200, {"success": True, "message": ""}

    def _one(self, ids, sp):
        count = (
            sp["max_new_tokens"]
            if self.cut_after is None
            else min(self.cut_after, sp["max_new_tokens"])
        )
        tokens = [100 + len(ids) + k for k in range(count)]
        finish = "abort" if self.cut_after is not None else "length"
        for k, token in enumerate(tokens):
            if token in sp["stop_token_ids"]:
                tokens, finish = tokens[: k + 1], "stop"
                break
        return sglang_output(tokens, [-0.01 * t for t in tokens], finish)

    def paths(self):
        return [path for _, path, _ in self.calls]


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


# ------------------------------------------------------------------ the in-process engine


class FakeLoop:
    def __init__(self):
        self.ran = []

    def is_running(self):
        return False

    def run_until_complete(self, coroutine):
        self.ran.append(coroutine)
        asyncio.run(coroutine)


class FakeEngine:
    """Records what ``SGLangEngine`` asks of ``sglang.Engine``; ``healthy`` False makes
    ``get_server_info`` fail."""

    def __init__(self):
        self.loop = FakeLoop()
        self.calls = []
        self.healthy = True
        manager = types.SimpleNamespace()
        manager.abort_request = lambda **kw: self.calls.append(("abort_request", kw))

        async def pause_generation(obj):
            self.calls.append(("pause_generation", obj.mode))

        async def continue_generation(obj):
            self.calls.append(("continue_generation", None))

        manager.pause_generation = pause_generation
        manager.continue_generation = continue_generation
        self.tokenizer_manager = manager

    def generate(self, **kwargs):
        assert threading.current_thread() is threading.main_thread()  # the loop's thread
        self.calls.append(("generate", kwargs))
        return [sglang_output([9], [-0.5]) for _ in kwargs["input_ids"]]

    def update_weights_from_tensor(self, **kwargs):
        self.calls.append(("update_weights_from_tensor", kwargs))
        return True, "Succeeded to update model weights."

    def flush_cache(self):
        self.calls.append(("flush_cache", None))
        return types.SimpleNamespace(success=True)

    def release_memory_occupation(self):
        self.calls.append(("release_memory_occupation", None))

    def resume_memory_occupation(self):
        self.calls.append(("resume_memory_occupation", None))

    def begin_weight_update(self):
        self.calls.append(("begin_weight_update", None))
        return True, ""

    def end_weight_update(self):
        self.calls.append(("end_weight_update", None))
        return False, "packed weights incomplete"

    def get_server_info(self):
        if not self.healthy:
            raise RuntimeError("scheduler died")
        return {}


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
