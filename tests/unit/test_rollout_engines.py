"""Conformance suite for rollout engines: every engine available here runs every test.

The embedded engine always runs. (vLLM and SGLang adapters join the ``ENGINES`` table where
they are installed.) The central check: the behaviour log-probs an engine records equal a
teacher-forced recompute, and equal the actor's own log-probs after the actor's weights were
pushed to the engine through the live export.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from bapo_megatron.rollout.checksum import checksum
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.embedded.sampling import next_tokens
from bapo_megatron.rollout.protocol import SamplingParams
from tests.helpers.tiny_models import tiny_model

MODEL = tiny_model(
    model_type="qwen2", max_position_embeddings=128, tie_word_embeddings=True, rope_theta=1e6
)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]


def random_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    engine = EmbeddedEngine(MODEL)
    return {name: p.detach().clone() for name, p in engine.model.named_parameters()}


def embedded_engine(weights: dict[str, torch.Tensor]) -> EmbeddedEngine:
    engine = EmbeddedEngine(MODEL)
    engine.update_weights(weights.items(), version=0)
    return engine


ENGINES = {"embedded": embedded_engine}


@pytest.fixture(params=sorted(ENGINES))
def make_engine(request):
    return ENGINES[request.param]


def teacher_forced(weights: dict[str, torch.Tensor], sample, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the sample's tokens, recomputed in one float64 forward."""
    reference = EmbeddedEngine(MODEL, dtype=torch.float64)
    reference.update_weights(weights.items(), version=0)
    ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(reference.model(ids).logits[0] / temperature, dim=-1)
    start = len(sample.prompt_token_ids)
    return logp[start - 1 : -1].gather(-1, torch.tensor(sample.token_ids)[:, None]).squeeze(-1)


def test_logprobs_match_a_teacher_forced_recompute(make_engine):
    weights = random_weights(0)
    engine = make_engine(weights)
    params = SamplingParams(n=2, temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=10, seed=3)
    samples = engine.generate(PROMPTS, params)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, i) for p in range(3) for i in range(2)
    ]
    for sample in samples:
        assert sample.finish_reason == "length" and len(sample.token_ids) == 10
        assert (
            sample.versions == [0] * 10 and sample.prompt_token_ids == PROMPTS[sample.prompt_index]
        )
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            teacher_forced(weights, sample, 0.7),
            rtol=0,
            atol=2e-5,
        )


def test_stop_tokens_seed_and_n(make_engine):
    engine = make_engine(random_weights(1))
    params = SamplingParams(
        n=4, temperature=1.5, max_new_tokens=30, seed=11, stop_token_ids=tuple(range(0, 128, 3))
    )
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]  # same seed, same rollout
    other = engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 12}))
    assert [s.token_ids for s in first] != [s.token_ids for s in other]
    stopped = [s for s in first if s.finish_reason == "stop"]
    assert stopped, "a third of the vocabulary stops: some sample must stop"
    for sample in first:
        if sample.finish_reason == "stop":
            assert sample.token_ids[-1] % 3 == 0 and all(t % 3 for t in sample.token_ids[:-1])
        else:
            assert sample.finish_reason == "length" and len(sample.token_ids) == 30
        assert len(sample.logprobs) == len(sample.versions) == len(sample.token_ids)


def test_partial_rollout_keeps_each_tokens_version_and_logprob(make_engine):
    old, new = random_weights(2), random_weights(3)
    engine = make_engine(old)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=5)
    samples = engine.generate(PROMPTS, params, round_tokens=4)
    assert all(s.finish_reason == "paused" and len(s.token_ids) == 4 for s in samples)
    digest = engine.update_weights(new.items(), version=1, checksum=True)
    assert digest == checksum(new.items())
    engine.continue_generation(samples, params, round_tokens=3)
    assert all(s.finish_reason == "paused" and s.versions == [0] * 4 + [1] * 3 for s in samples)
    engine.continue_generation(samples, params)
    for sample in samples:
        assert sample.finish_reason == "length" and sample.versions == [0] * 4 + [1] * 5
        # Each token's log-prob is the one of the policy that sampled it.
        logp = torch.tensor(sample.logprobs, dtype=torch.float64)
        torch.testing.assert_close(
            logp[:4], teacher_forced(old, sample, 1.0)[:4], rtol=0, atol=2e-5
        )
        torch.testing.assert_close(
            logp[4:], teacher_forced(new, sample, 1.0)[4:], rtol=0, atol=2e-5
        )


def after_first_tokens(engine, samples: int, action) -> None:
    """Have ``engine`` run ``action`` on another thread, and wait for it, once each of the next
    call's ``samples`` samples holds a token (then the engine sees the action before it decodes
    again, whatever the machine's speed). For the embedded engine: a one-shot forward hook, as
    every decoding step of all its samples is one forward. (The vLLM tier swaps in its own.)"""

    def hook(module, args, output):
        handle.remove()
        caller = threading.Thread(target=action)
        caller.start()
        caller.join()

    handle = engine.model.register_forward_hook(hook)


def test_abort_and_pause_from_another_thread(make_engine):
    engine = make_engine(random_weights(4))
    params = SamplingParams(n=2, max_new_tokens=100_000, seed=1)
    count = len(PROMPTS) * params.n
    after_first_tokens(engine, count, engine.abort)
    samples = engine.generate(PROMPTS, params)
    assert all(s.finish_reason == "abort" for s in samples)
    assert all(0 < len(s.token_ids) == len(s.logprobs) < 100_000 for s in samples)
    assert not any(s.resumable for s in samples)

    after_first_tokens(engine, count, engine.pause)
    samples = engine.generate(PROMPTS, params)
    assert all(s.finish_reason == "paused" for s in samples)
    paused_at = [len(s.token_ids) for s in samples]
    engine.continue_generation(samples, params)  # still paused: nothing generated
    assert [len(s.token_ids) for s in samples] == paused_at
    engine.resume()
    engine.continue_generation(
        samples, SamplingParams(n=2, max_new_tokens=max(paused_at) + 3, seed=1)
    )
    assert all(s.finish_reason == "length" for s in samples)
    assert all(len(s.token_ids) == max(paused_at) + 3 for s in samples)


def test_weight_updates_are_checked_and_memory_can_be_released(make_engine):
    weights = random_weights(5)
    engine = make_engine(weights)
    assert engine.health()
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))], version=1)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=f"'{name}' has shape \\(3, 3\\)"):
        engine.update_weights([(name, torch.zeros(3, 3))], version=1)
    good = random_weights(9)
    with pytest.raises(ValueError, match="'model.nope.weight' is not a parameter"):
        engine.update_weights([*good.items(), ("model.nope.weight", torch.zeros(1))], version=1)
    assert engine.version == 0
    params = SamplingParams(max_new_tokens=5, seed=2)
    before = engine.generate(PROMPTS, params)

    engine.release_memory()
    assert not engine.health()
    with pytest.raises(RuntimeError, match="release_memory"):
        engine.generate(PROMPTS, params)
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="before a complete update_weights"):
        engine.generate(PROMPTS, params)
    engine.update_weights(weights.items(), version=7)
    after = engine.generate(PROMPTS, params)
    assert [s.token_ids for s in after] == [s.token_ids for s in before]
    assert all(s.versions == [7] * 5 for s in after)


def test_bad_requests_are_refused():
    engine = embedded_engine(random_weights(6))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        engine.generate([[1, 500]], SamplingParams())
    context = MODEL.max_position_embeddings
    with pytest.raises(
        ValueError,
        match=rf"prompts\[0\] has {context} tokens; the model's context "
        rf"\(max_position_embeddings\) is {context}",
    ):
        engine.generate([[3] * context], SamplingParams())
    for bad in (
        {"temperature": 0.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"n": 0},
        {"max_new_tokens": 0},
    ):
        with pytest.raises(ValueError, match="sampling."):
            SamplingParams(**bad)


def test_a_response_ends_with_length_where_the_context_ends():
    engine = embedded_engine(random_weights(6))
    context = MODEL.max_position_embeddings
    samples = engine.generate(
        [[3] * (context - 5), [4, 5]], SamplingParams(n=2, max_new_tokens=9, seed=3)
    )
    assert [len(s.token_ids) for s in samples] == [5, 5, 9, 9]
    assert {s.finish_reason for s in samples} == {"length"}
    assert all(len(s.logprobs) == len(s.versions) == len(s.token_ids) for s in samples)


def test_sampling_follows_the_truncated_distribution_and_reports_the_full_one():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temperature, top_k, top_p = 0.8, 4, 0.8
    full = torch.softmax(logits[0].double() / temperature, -1)
    # top-k keeps 4 tokens; the nucleus of 0.8 over them keeps the first ones whose preceding
    # mass is below 0.8.
    kept = full[:top_k] / full[:top_k].sum()
    keep = (kept.cumsum(0) - kept) < top_p
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:top_k][keep] = kept[keep] / kept[keep].sum()
    generator = torch.Generator().manual_seed(0)
    draws = 20_000
    tokens, logprobs = next_tokens(
        logits.expand(draws, -1),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    freq = torch.bincount(tokens, minlength=6).double() / draws
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected).abs().max() < 4 * math.sqrt(0.25 / draws)
    torch.testing.assert_close(logprobs.double(), full.log()[tokens], rtol=0, atol=1e-6)


def test_embedded_release_keeps_the_buffers_the_weight_stream_does_not_carry():
    engine = EmbeddedEngine(MODEL)
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.update_weights(weights.items(), version=0)
    buffers = {name: b.clone() for name, b in engine.model.named_buffers()}
    assert buffers  # the rotary frequencies
    engine.release_memory()
    engine.resume_memory()  # allocates uninitialized memory
    engine.update_weights(weights.items(), version=1)
    for name, value in engine.model.named_buffers():
        assert torch.equal(value, buffers[name]), name
