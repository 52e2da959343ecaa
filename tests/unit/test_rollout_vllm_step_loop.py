"""The vLLM adapter's step loop against a fake ``vllm.LLMEngine`` (no vLLM needed): partial
rollout and versions, abort and pause, refusals, and the checks a weight update passes before
any tensor reaches vLLM, for each family's tensors."""

import logging

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.engine import (
    VLLMEngine,
)
from tests.helpers import hf_models
from tests.helpers.fake_vllm import (
    FakeLLM,
    FakeLLMEngine,
)
from tests.helpers.vllm_models import (
    VLLM_FAMILIES,
)


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
