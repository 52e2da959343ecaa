"""The shard-to-shard weight sync into an in-process vLLM at tensor parallel 2 (the optional vLLM
tier), against the broadcast path, through tests/distributed/shard_sync_worker.py: trainer TP2
(a qwen2 with q/k/v bias, tied, heads of 32) and a Qwen3-MoE at TP2 x EP2 in one launch of 2
processes, trainer TP2 x PP2 in one of 4. The vLLM server is in
tests/unit/test_rollout_vllm_server.py.

After each of three syncs with new weights, each worker's checksum of its parameters, the greedy
tokens and their log-probs equal those after the broadcast path synced the same weights; the
checksums the workers report are those; no trainer rank gathered a tensor. A rank that planned
with another bucket size stops every rank and the engine refuses to generate; a vLLM worker
killed in the middle of a sync ends every trainer rank with an error naming the bucket, and the
engine does not generate from what it half-received.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.test_shard_sync import check_results, launch
from tests.helpers import hf_models

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (optional tier: requirements-vllm.txt)",
)

EXPERT_FFN = 64
"""vLLM's CPU experts reload in place only unpadded: 32 per worker at TP 2."""


def dense_folder(tmp_path) -> None:
    hf_models.save_hf_folder(tmp_path / "hf", "qwen2-tied", seed=3, heads=2, kv_heads=2)


@pytest.mark.multiprocess
def test_vllm_tp2_receives_shard_to_shard_from_trainer_tp2_and_moe_ep2(tmp_path):
    dense_folder(tmp_path)
    hf_models.save_hf_moe_folder(tmp_path / "hf-moe", seed=4, expert_ffn=EXPERT_FFN)
    layouts = ["tp2", "tp2-sp-ep2"]
    results = launch(tmp_path, layouts, world=2, engine="vllm", kill=True, timeout=600)
    check_results(results, layouts)
    killed = [result["killed"] for result in results]
    pid = killed[0]["pid"]
    messages = {outcome["sync"] for outcome in killed}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("stopped during the shard-to-shard weight update to version 9")
    assert "bucket 2 of" in message, message
    refusal = killed[0]["generate"]
    assert pid and ("no whole policy weights" in refusal or f"pid {pid}" in refusal), refusal


@pytest.mark.multiprocess
def test_vllm_tp2_receives_shard_to_shard_from_trainer_tp2_pp2(tmp_path):
    dense_folder(tmp_path)
    results = launch(tmp_path, ["tp2pp2"], world=4, engine="vllm", timeout=600)
    check_results(results, ["tp2pp2"])
