"""The engine shard maps read off vLLM's own loaders
(:mod:`bapo_megatron.rollout.vllm.worker_shard_map`) against the maps
:mod:`bapo_megatron.models.vllm_shards` describes, on a running in-process vLLM: the vLLM tier's
test files call :func:`check_engine_shard_maps` with the engines they start anyway."""

from __future__ import annotations

import json

import numpy as np

from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.shard_map import (
    ShardMap,
    check_local_layout,
    coverage_counts,
    matrix_shape,
)
from bapo_megatron.models.shard_probe import mark_replicated
from bapo_megatron.models.vllm_shards import vllm_shard_map
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.worker_shard_map import shard_map_from_probe

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
PARAMS = SamplingParams(n=1, temperature=1.0, top_k=1, max_new_tokens=6, seed=0)
"""Top-1 sampling: the same tokens and log-probs from the same weights."""


def elements(shard_map: ShardMap, hf_shapes) -> dict[str, tuple]:
    """Per local tensor: which HF tensor and element each local element holds (-1: a fill),
    and which of them are replicated."""
    out = {}
    for local, shape in shard_map.shapes().items():
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


def check_engine_shard_maps(engine, tensor_parallel_size: int) -> list[ShardMap]:
    """Probe every worker of ``engine`` (an in-process ``VLLMEngine``), check the probe left its
    weights as they were (top-1 generation before and after), that every element reaches some
    worker, and that each worker's probed map equals the described one, element for element and
    run for run; returns the probed maps (replication marked)."""
    model = engine.model_config
    shapes = name_map_for(model.model_type).hf_shapes(model)
    request = json.dumps({"hf_shapes": {k: list(v) for k, v in shapes.items()}})
    before = engine.generate(PROMPTS, PARAMS)
    reports = engine._rpc("bapo_probe_shard_map", "probing", request)
    after = engine.generate(PROMPTS, PARAMS)
    assert [(s.token_ids, s.logprobs) for s in after] == [
        (s.token_ids, s.logprobs) for s in before
    ], "the probe changed the live weights"
    reports = sorted(reports, key=lambda report: report["tp_rank"])
    assert [r["tp_rank"] for r in reports] == list(range(tensor_parallel_size))
    maps = mark_replicated([shard_map_from_probe(r, r["tp_rank"]) for r in reports], shapes)
    assert all(report["unwritten"] == [] for report in reports)  # every HF tensor, every worker
    counts = coverage_counts((r for m in maps for r in m.regions), shapes)
    assert all((held >= 1).all() for held in counts.values())
    for probed in maps:
        check_local_layout(probed)  # every element of every written parameter once
        described = vllm_shard_map(model, probed.rank, tensor_parallel_size, probed.rank)
        assert probed.shapes() == described.shapes()
        got, want = elements(probed, shapes), elements(described, shapes)
        for local in want:
            for g, w, what in zip(got[local], want[local], ("tensor", "element", "replicated")):
                assert (g == w).all(), f"rank {probed.rank} {local}: {what} differs"
        # the probe compresses into the same runs the description gives
        assert sorted(probed.regions) == sorted(described.regions)
        assert sorted(probed.fills) == sorted(described.fills)
    return maps


def in_place_modules(engine) -> set[str]:
    """The modules of an in-process TP 1 engine's model (the worker in this process) that a
    shard-to-shard transfer writes where they live
    (:func:`~bapo_megatron.rollout.vllm.worker_shard_targets.writes_in_place`)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from bapo_megatron.rollout.vllm.worker_shard_targets import writes_in_place

    (model,) = engine._worker_rpc("bapo_model", "taking the model", None)
    chosen = set()
    for name, module in model.named_modules():
        params = [n for n, param in module._parameters.items() if param is not None]
        info = LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0] if info is not None else {}
        if params and writes_in_place(module, recorded, params):
            chosen.add(name)
    return chosen
