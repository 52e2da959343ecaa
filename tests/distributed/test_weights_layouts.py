"""HF <-> Megatron at TP1/PP1, TP2/PP1, TP1/PP2, TP2/PP2 and PP2 x VPP2, resharding, and the live
export at TP2/PP2 and PP2 x VPP2, in one launch of 4 gloo workers
(tests/distributed/weights_layouts_worker.py).

The parent builds five tiny transformers models (Llama untied, Qwen2 tied with q/k/v bias, Qwen3
tied and untied with q/k norms and its own head size, Llama 3.2-style tied with scaled RoPE; 4
layers so that each pipeline stage holds 2) and records transformers' logits. Each worker, for
every layout (data parallel fills the 4 ranks):

- converts the HF folder to a Megatron checkpoint at that layout and runs the pipeline forward:
  the logits must be transformers' (fp32, atol 1e-5);
- loads the checkpoint saved at TP2/PP2 at that layout: every parameter must be bitwise the one
  converted directly at that layout (resharding on load);
- at TP2/PP2: exports the weights live, in buckets of a small bound, in fp32 (into the first TP
  rank) and bf16 (into both TP ranks), through shared memory and through the gloo collective,
  and converts the TP2/PP2 checkpoint back to HF with every stage writing its own shards; at
  TP1/PP1 (DP4) converts it back again; at PP2 x VPP2 exports again (each stage holds
  interleaved layers).

The parent checks the exported tensors and both HF folders bitwise against the saved HF tensors
(the offline conversion of the same weights), the bucket bound, the versions, which stage sent
what, and that the folders load in transformers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.distributed.weights_layouts_worker import (
    BUCKET_BYTES,
    LAYERS,
    LAYOUTS,
    TRANSPORTS,
    VERSION,
)
from tests.distributed.weights_layouts_worker import VARIANTS as MP_VARIANTS
from tests.helpers import gloo_launch, hf_models

WORKER = Path(__file__).with_name("weights_layouts_worker.py")
LAUNCH_TIMEOUT_S = 300.0
WORLD = 4


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(HF reference per variant, every rank's results) of one 4-worker launch."""
    work = tmp_path_factory.mktemp("layouts")
    reference = {}
    for seed, variant in enumerate(MP_VARIANTS):
        model = hf_models.save_hf_folder(work / variant, variant, seed=seed + 10, layers=LAYERS)
        reference[variant] = dict(
            logits=hf_models.hf_logits(model), tensors=hf_models.read_hf_tensors(work / variant)
        )
    results = gloo_launch.launch(WORKER, WORLD, work, ["--workdir", work], LAUNCH_TIMEOUT_S)
    return work, reference, results


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_converted_checkpoint_gives_transformers_logits(launched, layout):
    _, reference, results = launched
    tp, pp, vpp = LAYOUTS[layout]
    last = [rank for rank, r in enumerate(results) if r["place", layout]["pp_rank"] == pp - 1]
    assert len(last) == WORLD // pp
    for variant in MP_VARIANTS:
        for rank, result in enumerate(results):
            logits = result["logits", variant, layout]
            if rank not in last:
                assert logits is None
                continue
            torch.testing.assert_close(
                logits,
                reference[variant]["logits"],
                rtol=0,
                atol=1e-5,
                msg=f"{variant} at {layout}, rank {rank}",
            )


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "tp2pp2"])
def test_tp2_pp2_checkpoint_loads_at_other_layouts(launched, layout):
    _, _, results = launched
    for variant in MP_VARIANTS:
        assert all(r["resharded", variant, layout] is True for r in results), variant


def exported_by_sender(results: list[dict], key: tuple) -> dict[int, list[dict]]:
    return {rank: r[key] for rank, r in enumerate(results) if r[key]}


def check_stage_buckets(
    buckets: list[dict], stage: int, layers: set[int], bound: int, version: int
) -> list[str]:
    """One stage's buckets are numbered, versioned, bounded and hold its layers; their names."""
    assert [b["index"] for b in buckets] == list(range(len(buckets))) and len(buckets) > 2
    assert [b["last"] for b in buckets] == [False] * (len(buckets) - 1) + [True]
    assert all(b["version"] == version and b["stage"] == stage for b in buckets)
    assert all(b["nbytes"] <= bound for b in buckets)
    names = [name for b in buckets for name in b["tensors"]]
    assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == layers
    assert ("model.embed_tokens.weight" in names) == (stage == 0)
    assert ("model.norm.weight" in names) == (stage == 1)
    return names


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("variant", MP_VARIANTS)
def test_live_export_at_tp2_pp2_equals_offline_conversion(launched, variant, transport):
    _, reference, results = launched
    original = reference[variant]["tensors"]
    places = [r["place", "tp2pp2"] for r in results]

    senders = exported_by_sender(results, ("export", variant, transport))
    # the first TP rank of each stage sends its own stage's layers, nobody else sends
    assert sorted(senders) == [rank for rank, p in enumerate(places) if p["tp_rank"] == 0]
    assert sorted(places[rank]["pp_rank"] for rank in senders) == [0, 1]
    exported: dict[str, torch.Tensor] = {}
    for rank, buckets in senders.items():
        stage = places[rank]["pp_rank"]
        names = check_stage_buckets(
            buckets, stage, {0, 1} if stage == 0 else {2, 3}, BUCKET_BYTES, VERSION
        )
        assert not set(names) & set(exported)
        exported.update((n, t) for b in buckets for n, t in b["tensors"].items())
    assert sorted(exported) == sorted(original)  # tied: no lm_head.weight, as HF saves it
    for name, tensor in exported.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name]), name

    # bf16 into every TP rank: both ranks of a stage get the same tensors, rounded from fp32
    everyone = exported_by_sender(results, ("export-bf16", variant, transport))
    assert sorted(everyone) == list(range(WORLD))
    for rank, buckets in everyone.items():
        stage = places[rank]["pp_rank"]
        check_stage_buckets(
            buckets, stage, {0, 1} if stage == 0 else {2, 3}, BUCKET_BYTES // 2, VERSION + 1
        )
        for name, tensor in ((n, t) for b in buckets for n, t in b["tensors"].items()):
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, original[name].to(torch.bfloat16)), (rank, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", MP_VARIANTS)
def test_push_weights_streams_every_stage_into_the_colocated_engine(launched, variant):
    _, reference, results = launched
    original = reference[variant]["tensors"]
    places = [r["place", "tp2pp2"] for r in results]
    engine_rank = next(
        rank for rank, p in enumerate(places) if p["tp_rank"] == 0 and p["pp_rank"] == 0
    )
    for rank, result in enumerate(results):
        if rank != engine_rank:  # nothing reached the other ranks
            assert result["push", variant] is None
    # the refusal stops every rank with the engine rank's error; none hangs waiting for it
    [message] = {result["push-refused", variant] for result in results}
    match = re.fullmatch(
        rf"stopped during the weight update to version {VERSION}: "
        rf"rank {engine_rank}: ValueError: refused (\S+)",
        str(message),
    )
    assert match and match.group(1) in original, message
    loaded, version = results[engine_rank]["push", variant]
    assert version == VERSION
    names = [name for name, _ in loaded]
    assert len(names) == len(set(names)) and sorted(names) == sorted(original)
    # stage 0's layers first, then stage 1's, each in HF order
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of) and layer_of[0] == 0 and layer_of[-1] == LAYERS - 1
    for name, tensor in loaded:
        assert tensor.dtype == torch.float32 and torch.equal(tensor, original[name]), name


@pytest.mark.multiprocess
def test_full_shared_memory_falls_back_to_the_collective_or_is_refused(launched):
    _, reference, results = launched
    variant = MP_VARIANTS[0]
    original = reference[variant]["tensors"]
    senders = exported_by_sender(results, ("export-shm-full", variant))
    exported = {
        n: t for buckets in senders.values() for b in buckets for n, t in b["tensors"].items()
    }
    assert len(senders) == 2 and sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)
    for result in results:  # every rank refuses, none hangs
        assert (
            "first TP rank could not allocate a bucket in /dev/shm"
            in result["refused-shm-full", variant]
        )
        assert "No space left on device" in result["refused-shm-full", variant]


@pytest.mark.multiprocess
def test_reused_shared_memory_buffer_is_refilled_bucket_after_bucket(launched):
    _, reference, results = launched
    variant = MP_VARIANTS[0]
    original = reference[variant]["tensors"]
    for round_ in range(2):
        exported, senders = {}, 0
        for result in results:
            kept, storages = result["export-reuse", variant, round_]
            if kept:
                senders += 1
                exported.update((n, t) for bucket in kept for n, t in bucket.items())
                if round_ == 1:  # the buffer has grown to the largest bucket: one storage
                    assert len(kept) > 2 and len(set(storages)) == 1
        assert senders == 2 and sorted(exported) == sorted(original)
        assert all(torch.equal(exported[name], original[name]) for name in original)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", MP_VARIANTS)
def test_live_export_with_virtual_stages(launched, variant):
    """PP2 x VPP2 over 4 layers: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3."""
    _, reference, results = launched
    original = reference[variant]["tensors"]
    senders = exported_by_sender(results, ("export-vpp", variant))
    assert len(senders) == WORLD  # TP1: every rank sends; DP2: both replicas
    exported: dict[str, torch.Tensor] = {}
    for rank, buckets in senders.items():
        stage = results[rank]["place", "pp2vpp2"]["pp_rank"]
        check_stage_buckets(buckets, stage, {0, 2} if stage == 0 else {1, 3}, BUCKET_BYTES, VERSION)
        exported.update((n, t) for b in buckets for n, t in b["tensors"].items())
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2pp2", "tp1pp1"])
def test_megatron_to_hf_from_tp2_pp2_is_bitwise_and_loads_in_transformers(launched, layout):
    from transformers import AutoModelForCausalLM

    work, reference, _ = launched
    for variant in MP_VARIANTS:
        folder = work / f"{variant}-back-{layout}"
        back = hf_models.read_hf_tensors(folder)
        original = reference[variant]["tensors"]
        assert sorted(back) == sorted(original)
        assert all(
            torch.equal(back[k], original[k]) and back[k].dtype == original[k].dtype
            for k in original
        )
        config = (folder / "config.json").read_bytes()
        assert config == (work / variant / "config.json").read_bytes()
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        torch.testing.assert_close(
            hf_models.hf_logits(model), reference[variant]["logits"], rtol=0, atol=0
        )
    assert not list(work.glob(".*.incomplete"))
