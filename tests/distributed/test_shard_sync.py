"""The shard-to-shard weight sync into the embedded engine, against today's broadcast path, on 4
gloo processes (tests/distributed/shard_sync_worker.py): trainer TP2 x DP2 and TP2 x PP2 (a tied
qwen2 with q/k/v bias and 1 key/value head per TP rank), and a Qwen3-MoE at TP2 x EP2 with
sequence parallelism (fused experts in the engine).

After each of three syncs with new weights, the engine's parameters, greedy tokens and log-probs
after the shard-to-shard sync equal (bitwise) those after the broadcast path synced the same
weights; no trainer rank gathered a tensor or assembled one whole; each rank moved what the plan
says. A rank that planned with another bucket size stops every rank with one message, and the
engine then refuses to generate. The next layout, with the same sync state, makes a new plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.shard_sync_worker import ROUNDS
from tests.helpers import gloo_launch, hf_models

WORKER = Path(__file__).with_name("shard_sync_worker.py")
WORLD = 4


def launch(
    tmp_path: Path,
    layouts: list[str],
    world: int = WORLD,
    engine: str = "embedded",
    url: str = "-",
    kill: bool = False,
    timeout: float = 300.0,
) -> list[dict]:
    """The worker's results (HF folders at ``tmp_path / "hf"``, dense, and ``"hf-moe"`` for
    the MoE layouts)."""
    flags = ["--workdir", tmp_path, "--engine", engine, "--layouts", ",".join(layouts)]
    flags += ["--url", url, "--kill", int(kill)]
    return gloo_launch.launch(WORKER, world, tmp_path, flags, timeout)


def check_results(results: list[dict], layouts: list[str], mismatch: bool = True) -> None:
    """What every test of the worker checks (``mismatch``: a rank planned with another bucket
    size, which needs two ranks)."""
    digests = []
    for name in layouts:
        engine_ranks = [r for r, result in enumerate(results) if "shards" in result[name, 1]]
        assert engine_ranks, name
        for round_ in range(1, ROUNDS + 1):
            for rank, result in enumerate(results):
                got = result[name, round_]
                assert got["gathers"] == 0, (name, round_, rank)
                sent, received = got["plan_bytes"]
                assert got["counts"].sent_bytes == sent.get(rank, 0), (name, rank)
                assert got["counts"].received_bytes == received.get(rank, 0), (name, rank)
                if rank not in engine_ranks:
                    continue
                shards, broadcast = got["shards"], got["broadcast"]
                assert shards["tokens"] == broadcast["tokens"], (name, round_)
                assert shards["logprobs"] == broadcast["logprobs"], (name, round_)
                held = shards["held"]
                if isinstance(held, dict):
                    assert sorted(held) == sorted(broadcast["held"])
                    for tensor, value in held.items():
                        assert torch.equal(value, broadcast["held"][tensor]), (name, tensor)
                else:
                    assert held == broadcast["held"], (name, round_)
                    # workers of their own report dicts; one in the rank's process, its checksum
                    reported = [r if isinstance(r, str) else r["checksum"] for r in got["reports"]]
                    assert reported == held
            # the weights changed from round to round
            if round_ > 1:
                before = results[engine_ranks[0]][name, round_ - 1]["shards"]["logprobs"]
                assert results[engine_ranks[0]][name, round_]["shards"]["logprobs"] != before
        digests.append(results[0][name, 1]["digest"])
        assert len({result[name, 1]["digest"] for result in results}) == 1
        if not mismatch:
            continue
        messages = {result[name, "mismatch"] for result in results}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert message.startswith("stopped during the shard-to-shard weight update to version 4")
        assert f"rank {len(results) - 1}: ValueError: plan digest" in message, message
        for rank in engine_ranks:
            refusal = results[rank][name, "after-mismatch"]
            assert "no whole policy weights" in refusal, refusal
    assert len(set(digests)) == len(digests)  # every layout made its own plan


@pytest.mark.multiprocess
def test_shard_to_shard_equals_the_broadcast_path_dense(tmp_path):
    hf_models.save_hf_folder(tmp_path / "hf", "qwen2-tied", seed=3)
    results = launch(tmp_path, ["tp2", "tp2pp2"])
    check_results(results, ["tp2", "tp2pp2"])
    # TP2 x PP2: rank 0's engine receives from all four ranks, and only its own TP rank's
    # halves of stage 0 arrive as copies in place
    tp2pp2 = [result["tp2pp2", 1]["counts"] for result in results]
    assert all(counts.sent_bytes > 0 for counts in tp2pp2[1:])


@pytest.mark.multiprocess
def test_shard_to_shard_equals_the_broadcast_path_moe(tmp_path):
    hf_models.save_hf_moe_folder(tmp_path / "hf-moe", seed=4)
    check_results(launch(tmp_path, ["tp2-sp-ep2"]), ["tp2-sp-ep2"])
