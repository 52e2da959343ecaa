"""The vLLM adapter's pure pieces, no vLLM needed: sampling arguments, the sampled token's
log-prob, the full-vocabulary hook, fused groups of a partial update, the worker extension."""

import importlib
import importlib.util
import types

import pytest
import torch

from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.engine import (
    check_fused_groups,
    check_seeded_sampling,
    check_truncation,
    sampled_logprobs,
    vllm_sampling_kwargs,
)
from bapo_megatron.rollout.vllm.worker_extension import (
    WORKER_EXTENSION,
    BapoWorkerExtension,
    full_vocab_logprobs_hook,
    retie_output_layer,
)
from tests.helpers.vllm_models import (
    Logprob,
    request,
)


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


class CutGroup:
    """A weight group whose sender died: every broadcast's wait raises as gloo's does."""

    def broadcast(self, tensors, options):
        return types.SimpleNamespace(wait=self.fail)

    @staticmethod
    def fail():
        raise RuntimeError("Read error [127.0.0.1]:13733: Connection reset by peer")


def test_a_cut_update_is_answered_not_raised_and_the_client_names_it():
    """Every worker answers a cut update (vLLM's executor would leave a second worker's raised
    answer queued for the server's next call); the client raises naming the workers, and the
    worker loaded nothing."""
    from bapo_megatron.rollout.vllm.server_client import VLLMServerClient

    worker = object.__new__(BapoWorkerExtension)
    worker._bapo_weight_groups = {"bapo-weights-1": (CutGroup(), "gloo")}
    worker._bapo_reload = lambda received: pytest.fail("a cut update was loaded")
    request_json = (
        '{"group_name": "bapo-weights-1", "names": ["model.norm.weight"], '
        '"dtypes": ["float32"], "shapes": [[4]], "checksum": true}'
    )
    answer = worker.bapo_receive_weights(request_json)
    assert answer == {
        "failed": "RuntimeError: Read error [127.0.0.1]:13733: Connection reset by peer"
    }

    client = object.__new__(VLLMServerClient)
    client.base_url, client.model_config = "http://127.0.0.1:1", None
    client.weight_group = types.SimpleNamespace(
        update=lambda received, checksum: None, answer={"results": [answer, answer]}
    )
    with pytest.raises(RuntimeError) as cut:
        client._load_weights(iter([("model.norm.weight", torch.ones(4))]), version=3, checksum=True)
    assert str(cut.value).startswith(
        "vLLM server at http://127.0.0.1:1: the update to version 3 was cut off, the server keeps "
        "its previous weights (worker 0: RuntimeError: Read error"
    )
    assert "; worker 1: RuntimeError" in str(cut.value)


# ------------------------------------------------------------------ the step loop, on a fake vLLM
