"""The vLLM adapters: request building and output parsing (always), the step loop against a fake
engine (always), and, where vLLM is installed (the optional tier, see requirements-vllm.txt),
the rollout conformance suite against a real in-process ``vllm.LLM``.

The conformance suite's model has head size 16, which vLLM's CPU attention refuses (it wants
32, 64, 80, ...). Rather than change the suite's model for every engine, this file runs the
suite's own test functions with its module-level ``MODEL`` swapped for a same-shaped model of
head size 32 (:data:`VLLM_MODEL`); everything else in those tests is unchanged.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import types
from dataclasses import dataclass, field

import pytest
import torch

import tests.test_rollout_engines as suite
from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.embedded import EmbeddedEngine
from bapo_megatron.rollout.external import RoundRequest
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams
from bapo_megatron.rollout.vllm_engine import (
    VLLMEngine,
    check_fused_groups,
    check_truncation,
    full_vocab_logprobs_hook,
    sampled_logprobs,
    vllm_sampling_kwargs,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (optional tier: "
                                "requirements-vllm.txt)")

# The suite's model with 2 heads of 32 instead of 4 of 16; a long context so that the suite's
# 100k-token abort test is cut by the abort, not by vLLM's context limit.
VLLM_MODEL = ModelConfig(model_type="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                         num_attention_heads=2, num_query_groups=1, vocab_size=128,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=1e6)


def request(context=(1, 2), cap=4, final=True, seed=None) -> RoundRequest:
    sample = RolloutSample(prompt_index=0, sample_index=0, prompt_token_ids=list(context))
    return RoundRequest(sample=sample, context=list(context), max_new_tokens=cap, final=final,
                        seed=seed)


# ------------------------------------------------------------------ pure pieces (no vLLM needed)


def test_sampling_kwargs_keep_only_the_protocols_stop_tokens():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=50,
                            stop_token_ids=(2, 9), seed=1)
    kwargs = vllm_sampling_kwargs(request(cap=7, seed=123), params)
    assert kwargs == dict(n=1, temperature=0.7, top_p=0.9, top_k=5, max_tokens=7, seed=123,
                          stop_token_ids=[2, 9], ignore_eos=True, logprobs=0,
                          skip_special_tokens=False)


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
    with pytest.raises(ValueError, match=r"out: 'logprobs'\[1\] holds no entry for the sampled token 4"):
        sampled_logprobs([7, 4], entries, "out")


def test_truncated_sampling_needs_the_full_vocabulary_hook():
    check_truncation(SamplingParams(top_k=5, top_p=0.9), full_vocab_logprobs=True)
    check_truncation(SamplingParams(), full_vocab_logprobs=False)
    for params in (SamplingParams(top_k=5), SamplingParams(top_p=0.5)):
        with pytest.raises(ValueError, match="sampling.top_k/top_p truncate"):
            check_truncation(params, full_vocab_logprobs=False)


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
    check_fused_groups([layer + "self_attn.q_proj.weight", layer + "self_attn.k_proj.weight",
                        layer + "self_attn.v_proj.weight", layer + "input_layernorm.weight"])
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' without "
                                         r"\['model.layers.1.mlp.gate_proj.weight'\]"):
        check_fused_groups([layer + "mlp.up_proj.weight"])


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
            finish = ("stop" if token in kwargs["stop_token_ids"]
                      else "length" if n + 1 == kwargs["max_tokens"] else None)
            if finish:
                self.finished.add(rid)
            entry = None if self.broken else [{token: Logprob(-0.1 * (n + 1))}]
            outputs.append(FakeOutput(rid, [FakeCompletion([token], entry, finish)], finish is not None))
        self.steps += 1
        if self.on_step:
            self.on_step(self)
        return outputs

    def abort_request(self, request_ids):
        self.aborted += request_ids

    def is_sleeping(self):
        return False


class FakeLLM:
    def __init__(self):
        self.llm_engine = FakeLLMEngine()
        self.rpcs: list[tuple[str, tuple]] = []
        self.prefix_resets = 0

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))

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
    assert all(kwargs["max_tokens"] == 3 and kwargs["output_kind"] == "delta"
               and kwargs["detokenize"] is False for *_, kwargs in added)
    seeds = [kwargs["seed"] for *_, kwargs in added]
    assert len(set(seeds)) == 4  # one seed per sample
    assert all(s.finish_reason == "paused" and s.token_ids == [10, 11, 12] for s in samples)
    assert samples[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])

    engine.update_weights([], version=1)
    assert llm.prefix_resets == 1
    engine.continue_generation(samples, params)
    resubmitted = llm.llm_engine.added[4:]
    assert [prompt for _, prompt, _ in resubmitted] == [[1, 2, 10, 11, 12]] * 2 + [[3, 10, 11, 12]] * 2
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
    [(method, (tensors,))] = llm.rpcs
    assert method == "bapo_load_weights" and [n for n, _ in tensors] == list(weights)
    with caplog.at_level(logging.WARNING):
        engine.release_memory()
        engine.resume_memory()
    assert "cannot release memory" in caplog.text
    assert engine.version == -1 and not engine.health()


# ------------------------------------------------------------------ the real vLLM (optional tier)


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    """One in-process vLLM for the module (starting one takes seconds to a minute here)."""
    folder = tmp_path_factory.mktemp("vllm-model")
    torch.manual_seed(0)
    EmbeddedEngine(VLLM_MODEL).model.save_pretrained(folder)
    engine = VLLMEngine.from_pretrained(folder, enforce_eager=True)
    yield engine
    del engine.llm


@pytest.fixture
def vllm_suite(vllm_engine, monkeypatch):
    """The suite's test functions with their model swapped for VLLM_MODEL, and a factory that
    loads the given weights into the shared engine."""
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)

    def make_engine(weights):
        vllm_engine.resume()
        vllm_engine.resume_memory()
        vllm_engine.update_weights(weights.items(), version=0)
        return vllm_engine

    return make_engine


@needs_vllm
def test_vllm_logprobs_match_a_teacher_forced_recompute(vllm_suite):
    suite.test_logprobs_match_a_teacher_forced_recompute(vllm_suite)


@needs_vllm
def test_vllm_stop_tokens_seed_and_n(vllm_suite):
    suite.test_stop_tokens_seed_and_n(vllm_suite)


@needs_vllm
def test_vllm_partial_rollout_keeps_each_tokens_version_and_logprob(vllm_suite):
    suite.test_partial_rollout_keeps_each_tokens_version_and_logprob(vllm_suite)


@needs_vllm
def test_vllm_abort_and_pause_from_another_thread(vllm_suite):
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
        torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float64),
                                   suite.teacher_forced(weights, sample, 1.0), rtol=0, atol=2e-5)
