"""Fakes of vLLM where none runs: the offline engine (``vllm.LLM`` and its ``LLMEngine``, put in
place by the ``fake_vllm`` fixture) and an OpenAI-compatible vLLM server (its
``/v1/completions`` answers and control routes)."""

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors.torch import load_file

from bapo_megatron.rollout.vllm.worker_extension import (
    summed,
)
from tests.helpers.vllm_models import Logprob


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict] | None
    finish_reason: str | None = None


@dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeCompletion]
    finished: bool


@dataclass
class FakeLLMEngine:
    """Emits one token per step per live request: the n-th is ``10 + n`` with log-prob
    ``-0.1 (n + 1)``; a request finishes at ``max_tokens`` (length) or on a stop token.
    ``on_step`` runs after each step."""

    added: list[tuple[str, list[int], dict]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    steps: int = 0
    on_step: object = None
    broken: bool = False

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, prompt["prompt_token_ids"], params.kwargs))
        self.counts[request_id] = 0
        return request_id + "-internal"  # vLLM returns its internal id; outputs carry ours

    def _live(self):
        return [a for a in self.added if a[0] not in self.finished and a[0] not in self.aborted]

    def has_unfinished_requests(self):
        return bool(self._live())

    def step(self):
        outputs = []
        for rid, _, kwargs in self._live():
            n = self.counts[rid]
            token = 10 + n
            self.counts[rid] = n + 1
            finish = (
                "stop"
                if token in kwargs["stop_token_ids"]
                else "length"
                if n + 1 == kwargs["max_tokens"]
                else None
            )
            if finish:
                self.finished.add(rid)
            entry = None if self.broken else [{token: Logprob(-0.1 * (n + 1))}]
            outputs.append(
                FakeOutput(rid, [FakeCompletion([token], entry, finish)], finish is not None)
            )
        self.steps += 1
        if self.on_step:
            self.on_step(self)
        return outputs

    def abort_request(self, request_ids):
        self.aborted += request_ids

    def is_sleeping(self):
        return False


class FakeLLM:
    def __init__(self, chunked_prefill=False):
        self.llm_engine = FakeLLMEngine()
        scheduler = types.SimpleNamespace(enable_chunked_prefill=chunked_prefill)
        self.llm_engine.vllm_config = types.SimpleNamespace(scheduler_config=scheduler)
        self.rpcs: list[tuple[str, tuple]] = []
        self.prefix_resets = 0
        self.workers = 1

    def collective_rpc(self, method, args=()):
        """Each of ``workers`` workers reports what it loaded as the worker extension does."""
        self.rpcs.append((method, args))
        if method == "bapo_load_weights":
            return [summed(*args) for _ in range(self.workers)]
        return [None] * self.workers

    def reset_prefix_cache(self):
        self.prefix_resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` module with the two names the step loop imports."""
    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kwargs: types.SimpleNamespace(kwargs=kwargs)
    submodule = types.ModuleType("vllm.sampling_params")
    submodule.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    module.sampling_params = submodule
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", submodule)
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)  # _on_cpu(): treat as CPU
    return module


def vllm_choice(tokens, logprobs, finish="length", *, ids=True):
    """One ``/v1/completions`` answer as vLLM 0.32 gives it (``return_token_ids``,
    ``return_tokens_as_token_ids``, ``logprobs=0``, ``--skip-tokenizer-init``)."""
    choice = {
        "index": 0,
        "text": "",
        "finish_reason": finish,
        "stop_reason": None,
        "logprobs": {
            "text_offset": [11 * i for i in range(len(tokens))],
            "token_logprobs": list(logprobs),
            "tokens": [f"token_id:{t}" for t in tokens],
            "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(tokens, logprobs)],
        },
        "prompt_token_ids": [1, 2, 3],
    }
    if ids:
        choice["token_ids"] = list(tokens)
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [choice],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": len(tokens),
            "total_tokens": 3 + len(tokens),
        },
    }


class FakeVLLMServer:
    """Answers ``/v1/completions`` with ``min(max_tokens, cut_after)`` tokens ``100 + k``
    (finish ``abort`` when cut), everything else with 200; records every call."""

    def __init__(self):
        self.calls = []
        self.cut_after = None
        self.on_complete = None
        self.device = "cpu"
        self.chunked_prefill = False
        self.hold = None
        self.workers = 2

    def __call__(self, method, path, body):
        self.calls.append((method, path, body))
        if path == "/abort_requests" and self.hold is not None:
            self.hold.set()
        if path == "/v1/completions":
            if self.hold is not None:  # held, as by a paused vLLM, until /abort_requests
                self.hold.wait(10)
                return 200, vllm_choice([], [], "abort")
            if self.on_complete:
                self.on_complete()
            count = (
                body["max_tokens"]
                if self.cut_after is None
                else min(self.cut_after, body["max_tokens"])
            )
            tokens = [100 + k for k in range(count)]
            finish = "abort" if self.cut_after is not None else "length"
            return 200, vllm_choice(tokens, [-0.5] * count, finish)
        if path == "/v1/models":
            return 200, {"data": [{"id": "served"}]}
        if path == "/collective_rpc" and body["method"] == "bapo_device":
            return 200, {"results": [self.device]}
        if path == "/collective_rpc" and body["method"] == "bapo_chunked_prefill":
            return 200, {"results": [{"enable_chunked_prefill": self.chunked_prefill}]}
        if path == "/collective_rpc" and body["method"] == "bapo_load_weights_from":
            request = json.loads(body["args"][0])
            self.loaded = load_file(Path(request["folder"]) / "model.safetensors")
            named = [(name, self.loaded[name]) for name in request["names"]]
            return 200, {"results": [summed(named, request["checksum"])] * self.workers}
        return 200, {"success": True}

    def paths(self):
        return [path for _, path, _ in self.calls]
