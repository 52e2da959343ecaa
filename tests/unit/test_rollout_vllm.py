"""The vLLM adapters: request building and output parsing (always), the step loop against a fake
engine (always), and, where vLLM is installed (the optional tier, see requirements-vllm.txt),
the rollout conformance suite against a real in-process ``vllm.LLM`` (against a real vLLM
server: tests/unit/test_rollout_vllm_server.py).

The conformance suite's model has head size 16, which vLLM's CPU attention refuses (it wants
32, 64, 80, ...). Rather than change the suite's model for every engine, this file runs the
suite's own test functions with its module-level ``MODEL`` swapped for a same-shaped model of
head size 32 (:data:`VLLM_MODEL`); everything else in those tests is unchanged. The central
check, behaviour log-probs equal to a teacher-forced recompute, also runs on the Qwen3 and Llama
3.x families (:data:`VLLM_FAMILIES`), each vLLM started on a folder transformers saved.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams
from bapo_megatron.rollout.resubmission import EngineOutput, RoundRequest
from bapo_megatron.rollout.vllm.engine import (
    VLLMEngine,
    check_fused_groups,
    check_seeded_sampling,
    check_truncation,
    sampled_logprobs,
    vllm_sampling_kwargs,
)
from bapo_megatron.rollout.vllm.server_client import (
    VLLMServerClient,
    completion_request,
    parse_completion_response,
)
from bapo_megatron.rollout.vllm.tensor_parallel import WorkerFailure, executor_of
from bapo_megatron.rollout.vllm.worker_extension import (
    WORKER_EXTENSION,
    BapoWorkerExtension,
    full_vocab_logprobs_hook,
    retie_output_layer,
    summed,
)
from tests.helpers import hf_models
from tests.helpers.vllm_shard_checks import check_engine_shard_maps, in_place_modules

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm is not installed (optional tier: requirements-vllm.txt)"
)

# The suite's model with 2 heads of 32 instead of 4 of 16; a long context so that the suite's
# 100k-token abort test is cut by the abort, not by vLLM's context limit.
VLLM_MODEL = ModelConfig(
    model_type="qwen2",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=128,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rope_theta=1e6,
)

# The families after Qwen2 (tests/helpers/hf_models.py variants), with heads of 32, and the
# helper's head counts that give them: Qwen3 with 4 heads of 32 on a 64-wide residual stream
# (head_dim != hidden / heads; q/k norms), untied; a Llama 3.2-style model with llama3 RoPE
# scaling whose low/high frequency factors and original context are not the defaults, tied.
VLLM_FAMILIES: dict[str, dict[str, int]] = {
    "qwen3-untied": {},
    "llama32-tied": {"heads": 2, "kv_heads": 1},
}


def request(context=(1, 2), cap=4, final=True, seed=None) -> RoundRequest:
    sample = RolloutSample(prompt_index=0, sample_index=0, prompt_token_ids=list(context))
    return RoundRequest(
        sample=sample, context=list(context), max_new_tokens=cap, final=final, seed=seed
    )


# ------------------------------------------------------------------ pure pieces (no vLLM needed)


def test_sampling_kwargs_keep_only_the_protocols_stop_tokens():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=50, stop_token_ids=(2, 9), seed=1
    )
    kwargs = vllm_sampling_kwargs(request(cap=7, seed=123), params)
    assert kwargs == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_tokens": 7,
        "seed": 123,
        "stop_token_ids": [2, 9],
        "ignore_eos": True,
        "logprobs": 0,
        "skip_special_tokens": False,
    }


@dataclass
class Logprob:  # vLLM's per-token entry: only .logprob is read
    logprob: float
    rank: int = 1


def test_sampled_logprobs_picks_the_sampled_tokens_entry():
    entries = [{7: Logprob(-0.5), 3: Logprob(-2.0)}, {9: Logprob(-1.25)}]
    assert sampled_logprobs([7, 9], entries, "out") == [-0.5, -1.25]
    assert sampled_logprobs([], [], "out") == []
    with pytest.raises(ValueError, match="out: missing 'logprobs'"):
        sampled_logprobs([7], None, "out")
    with pytest.raises(ValueError, match="out: 'logprobs' has 1 entries for 2 generated tokens"):
        sampled_logprobs([7, 9], entries[:1], "out")
    with pytest.raises(
        ValueError, match=r"out: 'logprobs'\[1\] holds no entry for the sampled token 4"
    ):
        sampled_logprobs([7, 4], entries, "out")


def test_truncated_sampling_needs_the_full_vocabulary_hook():
    check_truncation(SamplingParams(top_k=5, top_p=0.9), full_vocab_logprobs=True)
    check_truncation(SamplingParams(), full_vocab_logprobs=False)
    for params in (SamplingParams(top_k=5), SamplingParams(top_p=0.5)):
        with pytest.raises(ValueError, match="sampling.top_k/top_p truncate"):
            check_truncation(params, full_vocab_logprobs=False)


def test_seeded_sampling_is_refused_only_on_a_cpu_vllm_that_prefills_in_chunks():
    seeded, unseeded = SamplingParams(seed=3), SamplingParams()
    check_seeded_sampling(seeded, on_cpu=True, chunked_prefill=False, engine="E")
    check_seeded_sampling(seeded, on_cpu=False, chunked_prefill=True, engine="E")
    check_seeded_sampling(unseeded, on_cpu=True, chunked_prefill=True, engine="E")
    with pytest.raises(ValueError, match="sampling.seed: E runs on CPU with chunked prefill"):
        check_seeded_sampling(seeded, on_cpu=True, chunked_prefill=True, engine="E")


class TruncatingSampler:
    """Like vLLM 0.32's TopKTopPSampler.forward_cpu: masks the logits in place, then returns the
    log-probs renormalized over the kept tokens."""

    def forward(self, logits, generators, k, p):
        kth = logits.topk(int(k[0]), dim=-1).values[:, -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
        return logits.argmax(-1), logits.log_softmax(-1)


def test_hook_reports_full_vocabulary_logprobs_before_truncation():
    sampler = TruncatingSampler()
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    tokens, truncated = sampler.forward(logits.clone(), {}, torch.tensor([2]), None)
    assert truncated[0, 2] == float("-inf")
    assert full_vocab_logprobs_hook(sampler) is True
    assert full_vocab_logprobs_hook(sampler) is False  # installed once
    tokens_hooked, full = sampler.forward(logits.clone(), {}, torch.tensor([2]), None)
    assert torch.equal(tokens, tokens_hooked)
    torch.testing.assert_close(full, logits.log_softmax(-1))


def test_partial_updates_must_hold_whole_fused_groups():
    layer = "model.layers.1."
    check_fused_groups(
        [
            layer + "self_attn.q_proj.weight",
            layer + "self_attn.k_proj.weight",
            layer + "self_attn.v_proj.weight",
            layer + "input_layernorm.weight",
        ]
    )
    with pytest.raises(
        ValueError,
        match="'model.layers.1.mlp.up_proj.weight' without "
        r"\['model.layers.1.mlp.gate_proj.weight'\]",
    ):
        check_fused_groups([layer + "mlp.up_proj.weight"])


def test_the_worker_extension_path_names_the_class():
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is BapoWorkerExtension
    assert WORKER_EXTENSION == "bapo_megatron.rollout.vllm.worker_extension.BapoWorkerExtension"


def test_reload_reties_a_tied_output_layer():
    processed = []
    embedding = types.SimpleNamespace(weight=torch.nn.Parameter(torch.ones(2, 2)))
    head = types.SimpleNamespace(
        weight=torch.nn.Parameter(torch.zeros(2, 2)),  # the stale tensor
        quant_method=types.SimpleNamespace(process_weights_after_loading=processed.append),
    )
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(tie_word_embeddings=True),
        lm_head=head,
        model=types.SimpleNamespace(embed_tokens=embedding),
    )
    assert retie_output_layer(model) is True
    assert head.weight is embedding.weight and processed == [head]
    model.config.tie_word_embeddings = False
    assert retie_output_layer(model) is False


# ------------------------------------------------------------------ the step loop, on a fake vLLM


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


def test_step_loop_partial_rollout_and_versions(fake_vllm):
    llm = FakeLLM()
    engine = VLLMEngine(llm, suite.MODEL, version=0)
    params = SamplingParams(n=2, max_new_tokens=5, seed=7, stop_token_ids=(99,))
    samples = engine.generate([[1, 2], [3]], params, round_tokens=3)
    added = llm.llm_engine.added
    assert [prompt for _, prompt, _ in added] == [[1, 2], [1, 2], [3], [3]]
    assert all(
        kwargs["max_tokens"] == 3
        and kwargs["output_kind"] == "delta"
        and kwargs["detokenize"] is False
        for *_, kwargs in added
    )
    seeds = [kwargs["seed"] for *_, kwargs in added]
    assert len(set(seeds)) == 4  # one seed per sample
    assert all(s.finish_reason == "paused" and s.token_ids == [10, 11, 12] for s in samples)
    assert samples[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])

    engine.update_weights([], version=1)
    assert llm.prefix_resets == 1
    engine.continue_generation(samples, params)
    resubmitted = llm.llm_engine.added[4:]
    assert [prompt for _, prompt, _ in resubmitted] == [[1, 2, 10, 11, 12]] * 2 + [
        [3, 10, 11, 12]
    ] * 2
    assert all(kwargs["max_tokens"] == 2 for *_, kwargs in resubmitted)
    for sample in samples:
        assert sample.finish_reason == "length"
        assert sample.token_ids == [10, 11, 12, 10, 11] and sample.versions == [0, 0, 0, 1, 1]


def test_step_loop_abort_and_pause_keep_what_was_generated(fake_vllm):
    llm = FakeLLM()
    engine = VLLMEngine(llm, suite.MODEL, version=0)
    params = SamplingParams(max_new_tokens=50)
    llm.llm_engine.on_step = lambda fake: fake.steps == 2 and engine.abort()
    samples = engine.generate([[1], [2]], params)
    assert [s.finish_reason for s in samples] == ["abort", "abort"]
    assert [s.token_ids for s in samples] == [[10, 11]] * 2
    assert len(llm.llm_engine.aborted) == 2  # the unfinished requests were aborted in vLLM

    llm.llm_engine = FakeLLMEngine()
    llm.llm_engine.on_step = lambda fake: fake.steps == 1 and engine.pause()
    samples = engine.generate([[1]], params)
    assert samples[0].finish_reason == "paused" and samples[0].token_ids == [10]
    engine.continue_generation(samples, params)  # still paused: nothing sent
    assert len(llm.llm_engine.added) == 1 and samples[0].token_ids == [10]
    engine.resume()
    engine.continue_generation(samples, SamplingParams(max_new_tokens=3))
    assert samples[0].finish_reason == "length" and samples[0].token_ids == [10, 10, 11]


def test_step_loop_refuses_seeds_where_chunked_prefill_would_crash_vllm(fake_vllm):
    llm = FakeLLM(chunked_prefill=True)
    engine = VLLMEngine(llm, suite.MODEL, version=0)  # fake_vllm: on CPU
    with pytest.raises(ValueError, match="sampling.seed: vLLM runs on CPU with chunked prefill"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2, seed=4))
    assert llm.llm_engine.added == []
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].token_ids == [10, 11]


def test_step_loop_refuses_outputs_without_logprobs(fake_vllm):
    llm = FakeLLM()
    llm.llm_engine.broken = True
    engine = VLLMEngine(llm, suite.MODEL, version=0)
    with pytest.raises(ValueError, match="vLLM request 0: missing 'logprobs'"):
        engine.generate([[1]], SamplingParams(max_new_tokens=3))
    assert llm.llm_engine.aborted  # nothing left running in vLLM


def test_weight_update_checks_before_anything_reaches_vllm(fake_vllm, caplog):
    llm = FakeLLM()
    engine = VLLMEngine(llm, suite.MODEL, version=0)
    weights = suite.random_weights(0)
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))], version=1)
    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match="without"):
        engine.update_weights([(name, weights[name])], version=1)
    assert llm.rpcs == [] and engine.version == 0
    digest = engine.update_weights(weights.items(), version=2, checksum=True)
    assert digest == suite.checksum(weights.items())
    [(method, (tensors, asked))] = llm.rpcs
    assert method == "bapo_load_weights" and [n for n, _ in tensors] == list(weights) and asked
    with caplog.at_level(logging.WARNING):
        engine.release_memory()
        engine.resume_memory()
    assert "cannot release memory" in caplog.text
    assert engine.version == -1 and not engine.health()


@pytest.mark.parametrize("variant", sorted(VLLM_FAMILIES))
def test_weight_update_checks_know_each_familys_tensors(fake_vllm, variant, tmp_path):
    """The update of a family's HF tensors as transformers saves them passes the name and shape
    checks whole (Qwen3's q/k norms are head_dim wide); a q/k norm of another width, or one in a
    Llama, is refused before anything reaches vLLM."""
    hf_models.save_hf_folder(tmp_path, variant, **VLLM_FAMILIES[variant])
    tensors = hf_models.read_hf_tensors(tmp_path)
    llm = FakeLLM()
    engine = VLLMEngine(llm, ModelConfig.from_hf_config(tmp_path), version=0)
    engine.update_weights(tensors.items(), version=1)
    [(method, (loaded, _))] = llm.rpcs
    assert method == "bapo_load_weights" and [n for n, _ in loaded] == list(tensors)
    q_norm = "model.layers.1.self_attn.q_norm.weight"
    if variant.startswith("qwen3"):
        assert tensors[q_norm].shape == (hf_models.QWEN3_HEAD_DIM,)
        message = rf"'{q_norm}' has shape \(16,\), the model expects \(32,\)"
    else:
        assert q_norm not in tensors
        message = f"'{q_norm}' is not a parameter of this llama model"
    with pytest.raises(ValueError, match=message):  # 16: hidden / heads
        engine.update_weights([(q_norm, torch.ones(16))], version=2)
    assert engine.version == 1 and len(llm.rpcs) == 1


# ------------------------------------------------------------------ the real vLLM (optional tier)


TENSOR_PARALLEL = (1, 2)
"""The engine sizes every real-vLLM test runs at: one worker in this process, and two worker
processes (vLLM's multiprocess executor). VLLM_MODEL and the Llama have one key/value head, which
vLLM replicates on both workers; the Qwen3 has two, one per worker."""


@pytest.fixture(scope="module")
def vllm_engines(tmp_path_factory):
    """In-process vLLMs on one folder of VLLM_MODEL, by tensor-parallel size, each started when
    a test first asks for it and kept for the module (a start takes seconds, more at TP 2)."""
    folder = tmp_path_factory.mktemp("vllm-model")
    torch.manual_seed(0)
    EmbeddedEngine(VLLM_MODEL).model.save_pretrained(folder)
    engines: dict[int, VLLMEngine] = {}

    def engine_at(tensor_parallel_size: int) -> VLLMEngine:
        if tensor_parallel_size not in engines:
            engines[tensor_parallel_size] = VLLMEngine.from_pretrained(
                folder, enforce_eager=True, tensor_parallel_size=tensor_parallel_size
            )
        return engines[tensor_parallel_size]

    yield engine_at
    for engine in engines.values():
        engine.close()


def suite_factory(engine: VLLMEngine):
    """The suite's ``make_engine``: loads the given weights into ``engine`` (checking that every
    worker loaded the bytes sent) and hands it over."""

    def make_engine(weights):
        engine.resume()
        engine.resume_memory()
        engine.update_weights(weights.items(), version=0, checksum=True)
        return engine

    return make_engine


@pytest.fixture(params=TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
def vllm_suite(request, vllm_engines, monkeypatch):
    """The suite's test functions with their model swapped for VLLM_MODEL, and a factory that
    loads the given weights into the shared engine of each size."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    return suite_factory(vllm_engines(request.param))


@pytest.fixture(scope="module")
def vllm_family_engines(tmp_path_factory):
    """Starts one in-process vLLM per family of VLLM_FAMILIES and size, on a folder transformers
    saved (seed 100: the tests load other weights), when a test first asks for it; each is kept
    for the module."""
    engines: dict[tuple[str, int], VLLMEngine] = {}
    probes: dict[tuple[str, int], object] = {}

    def engine_for(variant: str, tensor_parallel_size: int) -> VLLMEngine:
        key = (variant, tensor_parallel_size)
        if key not in engines:
            folder = tmp_path_factory.mktemp(variant)
            hf_models.save_hf_folder(folder, variant, seed=100, **VLLM_FAMILIES[variant])
            engines[key] = VLLMEngine.from_pretrained(
                folder, enforce_eager=True, tensor_parallel_size=tensor_parallel_size
            )
            # the shard-map probe runs once per engine start, before any in-place reload
            try:
                probes[key] = check_engine_shard_maps(engines[key], tensor_parallel_size)
            except AssertionError as failure:
                probes[key] = failure
        return engines[key]

    engine_for.probes = probes
    yield engine_for
    for engine in engines.values():
        engine.close()


@pytest.fixture(
    params=[(variant, tp) for variant in ("qwen2", *VLLM_FAMILIES) for tp in TENSOR_PARALLEL],
    ids=lambda param: f"{param[0]}-tp{param[1]}",
)
def vllm_family_suite(request, monkeypatch, tmp_path, vllm_engines):
    """:func:`vllm_suite` for each family and size: VLLM_MODEL's shared engines for qwen2; for
    the others the family's engine, with the suite's ``MODEL`` the config that engine read from
    its folder (so the suite's teacher-forced recompute is the embedded engine's, i.e.
    transformers', on that family) and the suite's ``random_weights(seed)`` the HF tensors
    transformers saves for the family with that seed (random norms included, so a dropped or
    swapped q/k norm shows)."""
    variant, tensor_parallel_size = request.param
    if variant == "qwen2":
        monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
        return suite_factory(vllm_engines(tensor_parallel_size))
    engine = request.getfixturevalue("vllm_family_engines")(variant, tensor_parallel_size)
    monkeypatch.setattr(suite, "MODEL", engine.model_config)

    def random_weights(seed: int) -> dict[str, torch.Tensor]:
        folder = tmp_path / f"seed-{seed}"
        hf_models.save_hf_folder(folder, variant, seed=seed, **VLLM_FAMILIES[variant])
        return hf_models.read_hf_tensors(folder)

    monkeypatch.setattr(suite, "random_weights", random_weights)
    return suite_factory(engine)


@needs_vllm
def test_vllm_logprobs_match_a_teacher_forced_recompute(vllm_family_suite):
    suite.test_logprobs_match_a_teacher_forced_recompute(vllm_family_suite)


@needs_vllm
@pytest.mark.parametrize("tp", TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("variant", sorted(VLLM_FAMILIES))
def test_vllm_family_shard_maps_equal_what_vllms_loaders_do(vllm_family_engines, variant, tp):
    """Each worker's shard map read off vLLM's own loaders equals the described one
    (tests/helpers/vllm_shard_checks.py), probed on the family engines of the log-prob check as
    each started."""
    vllm_family_engines(variant, tp)
    outcome = vllm_family_engines.probes[(variant, tp)]
    if isinstance(outcome, AssertionError):
        raise outcome
    assert len(outcome) == tp


@needs_vllm
def test_vllm_layers_written_in_place_are_those_whose_processing_keeps_them(
    vllm_family_engines, tmp_path
):
    """Shard to shard, a layer is written where it lives, then processed again, when vLLM's
    post-load processing keeps its checkpoint-format parameters where they are: the norms (no
    processing), and the embedding and output layers (vLLM's CPU build packs a copy beside the
    weight; on CUDA their processing does nothing). vLLM's CPU packing drops a linear layer's
    weight, so linear layers are taken apart and put together."""
    engine = vllm_family_engines("qwen3-untied", 1)
    hf_models.save_hf_folder(tmp_path, "qwen3-untied", seed=3, **VLLM_FAMILIES["qwen3-untied"])
    weights = hf_models.read_hf_tensors(tmp_path)
    engine.update_weights(weights.items(), version=1)  # judged after an in-place reload
    in_place = in_place_modules(engine)
    norms = {name for name in in_place if name.endswith("norm")}
    assert in_place - norms == {"model.embed_tokens", "lm_head"}
    assert {
        "model.norm",
        "model.layers.0.self_attn.k_norm",
        "model.layers.1.input_layernorm",
    } <= norms
    layer = "model.layers.0"
    assert not in_place & {f"{layer}.self_attn.qkv_proj", f"{layer}.mlp.gate_up_proj"}


@needs_vllm
def test_vllm_updates_of_a_tied_model_log_no_warning(vllm_family_engines, tmp_path):
    """vLLM's in-place reload warned on every update "ParallelLMHead: Failed to load weights"
    (the tied output layer, which a tied checkpoint does not hold) and "RotaryEmbedding: ..."
    (its non-persistent cache), until the worker told it which tensors never come
    (bapo_megatron/rollout/vllm/reload_expectations.py). Its loggers, read in this process (the
    one worker of TP 1 lives here), must log no warning during an update; the log-prob check on
    the same family (test_vllm_logprobs_match_a_teacher_forced_recompute) checks the weights."""
    engine = vllm_family_engines("llama32-tied", 1)
    hf_models.save_hf_folder(tmp_path, "llama32-tied", seed=5, **VLLM_FAMILIES["llama32-tied"])
    weights = hf_models.read_hf_tensors(tmp_path)
    assert "lm_head.weight" not in weights  # what a tied checkpoint, and the trainer, send
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload")
    reload_logger.addHandler(handler)
    try:
        engine.update_weights(weights.items(), version=1)
    finally:
        reload_logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == []


@needs_vllm
@pytest.mark.parametrize("tp", TENSOR_PARALLEL, ids=lambda tp: f"tp{tp}")
def test_vllm_qwen2_shard_maps_equal_what_vllms_loaders_do(vllm_engines, tp):
    """The same on the module's Qwen2 engines (q/k/v bias, tied, one key/value head that both
    workers of TP 2 hold), probed whenever this runs: after in-place reloads too."""
    assert len(check_engine_shard_maps(vllm_engines(tp), tp)) == tp


@needs_vllm
def test_vllm_stop_tokens_seed_and_n(vllm_suite):
    suite.test_stop_tokens_seed_and_n(vllm_suite)


@needs_vllm
def test_vllm_partial_rollout_keeps_each_tokens_version_and_logprob(vllm_suite):
    suite.test_partial_rollout_keeps_each_tokens_version_and_logprob(vllm_suite)


# Six requests of 1500+ tokens: more prompt tokens than one step of vLLM takes by default
# (max_num_batched_tokens 4096 in process, 2048 for a server), so a vLLM that prefills in chunks
# splits them, and on CPU its worker then crashes on the seeded requests' generators
# ("CPU Generator does not use offset"; see bapo_megatron/rollout/vllm/engine.py).
LONG_PROMPTS = [[(5 * i + k) % 128 for i in range(1500)] for k in range(3)]


def long_seeded_continuations(make_engine) -> None:
    """Seeded rounds of long prompts, each continued after a weight update (which resets the
    prefix cache, so every continuation is prefilled whole, as in a training run), twice: both
    runs finish and give the same tokens."""
    weights = suite.random_weights(10)
    engine = make_engine(weights)
    params = SamplingParams(n=2, max_new_tokens=6, seed=9)
    runs = []
    for _ in range(2):
        samples = engine.generate(LONG_PROMPTS, params, round_tokens=2)
        while any(sample.resumable for sample in samples):
            engine.update_weights(weights.items(), version=engine.version + 1)
            engine.continue_generation(samples, params, round_tokens=2)
        assert all(s.finish_reason == "length" and len(s.token_ids) == 6 for s in samples)
        runs.append([s.token_ids for s in samples])
    assert runs[0] == runs[1]


@needs_vllm
def test_vllm_long_seeded_continuations_run_and_repeat(vllm_suite):
    engine = vllm_suite(suite.random_weights(10))
    assert not engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    long_seeded_continuations(vllm_suite)


def after_first_vllm_tokens(engine, samples, action):
    """The suite's ``after_first_tokens`` for the in-process engine: wraps ``llm_engine.step``
    until every one of the call's ``samples`` requests has output a token, then runs ``action``
    on another thread and waits for it; the step loop sees it before its next step."""
    llm_engine = engine.llm.llm_engine
    step, seen = llm_engine.step, set()

    def first_steps():
        outputs = step()
        seen.update(o.request_id for o in outputs if o.outputs[0].token_ids)
        if len(seen) >= samples:
            del llm_engine.step  # back to the class's own
            caller = threading.Thread(target=action)
            caller.start()
            caller.join()
        return outputs

    llm_engine.step = first_steps


@needs_vllm
def test_vllm_abort_and_pause_from_another_thread(vllm_suite, monkeypatch):
    monkeypatch.setattr(suite, "after_first_tokens", after_first_vllm_tokens)
    suite.test_abort_and_pause_from_another_thread(vllm_suite)


@needs_vllm
def test_vllm_weight_updates_are_checked_and_memory_can_be_released(vllm_suite):
    suite.test_weight_updates_are_checked_and_memory_can_be_released(vllm_suite)


@needs_vllm
def test_vllm_refuses_bad_prompts(vllm_suite):
    engine = vllm_suite(suite.random_weights(6))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        engine.generate([[1, 500]], SamplingParams())


@needs_vllm
def test_vllm_logprobs_are_full_vocabulary_under_top_k(vllm_suite):
    """With top-k 3, vLLM's own processed_logprobs would be renormalized over 3 tokens (each
    >= log 1/3 ... summing to 1); the hook reports the full-vocabulary ones."""
    weights = suite.random_weights(8)
    engine = vllm_suite(weights)
    params = SamplingParams(n=4, top_k=3, max_new_tokens=6, seed=2)
    for sample in engine.generate(suite.PROMPTS, params):
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            suite.teacher_forced(weights, sample, 1.0),
            rtol=0,
            atol=2e-5,
        )


# ------------------------------------------------------------- tensor parallel 2 (optional tier)

# float32 tolerance between the two sizes: at TP 2 each worker sums half of every row-parallel
# product and an all-reduce adds the halves, which rounds differently from one sum (seen: 1e-6).
TP_LOGPROB_ATOL = 1e-5


@needs_vllm
def test_vllm_tp2_generates_what_tp1_generates_on_the_same_weights(vllm_engines, monkeypatch):
    """After the same update (every worker of both engines reports the bytes sent), greedy
    tokens (top-k 1) and seeded samples of the TP 2 engine equal the TP 1 engine's, log-probs
    within :data:`TP_LOGPROB_ATOL`; VLLM_MODEL's single key/value head is replicated on both
    workers."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    weights = suite.random_weights(11)
    engines = [vllm_engines(tp) for tp in TENSOR_PARALLEL]
    digests = {e.update_weights(weights.items(), version=3, checksum=True) for e in engines}
    assert digests == {suite.checksum(weights.items())}
    for params in (
        SamplingParams(n=1, top_k=1, max_new_tokens=24),
        SamplingParams(n=2, max_new_tokens=24, seed=4),
    ):
        one, two = (engine.generate(suite.PROMPTS, params) for engine in engines)
        assert [s.token_ids for s in one] == [s.token_ids for s in two]
        for a, b in zip(one, two):
            assert a.versions == b.versions == [3] * len(a.token_ids)
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=TP_LOGPROB_ATOL
            )


def run_bounded(action, deadline_s: float = 600.0):
    """``action()`` on another thread; its result or error. The deadline only bounds a hang
    (the call must end by itself, whatever the machine's speed)."""
    result: dict = {}

    def run():
        try:
            result["value"] = action()
        except BaseException as error:
            result["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(deadline_s)
    assert not worker.is_alive(), f"still running after {deadline_s} s: a hang"
    return result


@needs_vllm
def test_a_tp2_engine_whose_worker_cannot_start_is_refused(tmp_path):
    """A worker extension that does not import makes both worker processes fail at start: the
    engine's start ends with an error that says so and where their tracebacks are."""
    torch.manual_seed(0)
    EmbeddedEngine(VLLM_MODEL).model.save_pretrained(tmp_path)
    outcome = run_bounded(
        lambda: VLLMEngine.from_pretrained(
            tmp_path,
            enforce_eager=True,
            tensor_parallel_size=2,
            worker_extension_cls="bapo_megatron.rollout.vllm.no_such_module.Extension",
        )
    )
    error = outcome.get("error")
    assert isinstance(error, WorkerFailure), outcome
    assert (
        "tensor_parallel_size=2: a worker process (VllmWorker-0, VllmWorker-1) failed to start"
        in str(error)
    )


@needs_vllm
def test_a_tp2_worker_that_dies_is_named_and_the_engine_stops_serving(vllm_engines, monkeypatch):
    """SIGKILL one of two worker processes of the module's TP 2 engine once every sample holds a
    token: the generation call ends with an error naming that worker and its exit, the engine
    reports itself unhealthy and refuses further calls with the same kind of error. It ends that
    engine: the module's last test to use it."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)
    engine = vllm_engines(2)
    engine.update_weights(suite.random_weights(12).items(), version=1)
    worker = executor_of(engine.llm).workers[1].proc
    kill = lambda: os.kill(worker.pid, signal.SIGKILL)  # noqa: E731
    after_first_vllm_tokens(engine, len(suite.PROMPTS), kill)
    params = SamplingParams(max_new_tokens=400)
    outcome = run_bounded(lambda: engine.generate(suite.PROMPTS, params))
    error = outcome.get("error")
    assert isinstance(error, WorkerFailure), outcome
    assert f"VllmWorker-1 (pid {worker.pid}, exit code -9)" in str(error)
    assert "while generating" in str(error) and not engine.health()
    again = run_bounded(lambda: engine.update_weights(suite.random_weights(12).items(), version=2))
    assert isinstance(again.get("error"), WorkerFailure), again


# ------------------------------------------------------------------ the server client (no vLLM)


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
