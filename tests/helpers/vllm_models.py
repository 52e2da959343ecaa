"""The models, requests and routines the vLLM adapters' tests share (tests/unit/test_rollout_vllm_*,
tests/vllm/)."""

from dataclasses import dataclass

import tests.unit.test_rollout_engines as suite
from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.protocol import RolloutSample, SamplingParams
from bapo_megatron.rollout.resubmission import RoundRequest

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


@dataclass
class Logprob:  # vLLM's per-token entry: only .logprob is read
    logprob: float
    rank: int = 1


TENSOR_PARALLEL = (1, 2)
"""The engine sizes every real-vLLM test runs at: one worker in this process, and two worker
processes (vLLM's multiprocess executor). VLLM_MODEL and the Llama have one key/value head, which
vLLM replicates on both workers; the Qwen3 has two, one per worker."""


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
