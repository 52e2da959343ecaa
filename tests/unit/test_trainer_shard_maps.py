"""The trainer's shard maps (bapo_megatron/models/trainer_shards.py): the placements computed from
the layout equal those read off Megatron's own model shards on the meta device (names, shapes,
partition dimension and stride, pipeline layer offsets, expert placement), and the shards a map
describes equal the name maps' tested merge of tensor-parallel slices, for every family."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bapo_megatron.config import ParallelConfig
from bapo_megatron.config.loading import load_config
from bapo_megatron.models.name_maps import merge, name_map_for, tp_slice
from bapo_megatron.models.shard_map import check_local_layout, coverage_counts, matrix_shape
from bapo_megatron.models.trainer_shards import (
    ParamPlacement,
    TrainerRank,
    chunk_placements,
    layout_placements,
    trainer_shard_map,
)
from bapo_megatron.planning import simulated_rank as simulated
from tests.helpers.gloo_launch import REPO_ROOT
from tests.unit.test_reshard_plan import model_of


def shard_of(model, placements, rank: int, at: TrainerRank, full) -> dict[str, np.ndarray]:
    """The rank's local tensors filled from the full HF tensors through its shard map."""
    shard_map = trainer_shard_map(model, placements, rank, at)
    check_local_layout(shard_map)
    local = {name: np.zeros(int(np.prod(shape))) for name, shape in shard_map.local_shapes}
    for region in shard_map.regions:
        cols = matrix_shape(full[region.hf].shape)[1]
        values = full[region.hf].reshape(-1)[region.hf_indices(cols)]
        local[region.local][region.local_indices()] = values
    return {name: local[name].reshape(shape) for name, shape in shard_map.local_shapes}


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_map_shards_equal_the_name_maps_merge_of_tp_slices(family, tp):
    model = model_of(family, kv_heads=4, tied=False)
    model = dataclasses.replace(model, vocab_size=152)  # Megatron's rows divide the TP size
    name_map = name_map_for(family)
    rules = {rule.megatron: rule for rule in name_map.rules(model)}
    rng = np.random.default_rng(1)
    full = {n: rng.standard_normal(s) for n, s in name_map.hf_shapes(model).items()}
    holders = []
    for rank in range(tp):
        at = TrainerRank(tp_rank=rank, tp_size=tp, etp_rank=rank, etp_size=tp)
        placements = layout_placements(model, at)
        shards = shard_of(model, placements, rank, at, full)
        assert sorted(shards) == sorted(p.name for p in placements)
        for name, shard in shards.items():
            rule = rules[name]
            parts = [torch.from_numpy(full[hf]) for hf in rule.hf]
            if rule.tp_dim is not None:
                parts = [
                    p[
                        (slice(None),) * rule.tp_dim
                        + (tp_slice(rule, p.shape[rule.tp_dim], rank, tp),)
                    ]
                    for p in parts
                ]
            np.testing.assert_array_equal(shard, merge(rule, parts, model).numpy(), err_msg=name)
        holders.append(trainer_shard_map(model, placements, rank, at))
    counts = coverage_counts((r for m in holders for r in m.regions), name_map.hf_shapes(model))
    for hf, count in counts.items():  # once, or once per rank when every rank keeps it whole
        assert set(count) in ({1}, {tp}), hf


def test_padded_vocabulary_rows_are_fills():
    model = model_of("qwen2", kv_heads=2, tied=True)  # vocabulary 150
    at = TrainerRank(tp_rank=1, tp_size=2)
    shard_map = trainer_shard_map(model, layout_placements(model, at, padded_vocab=160), 1, at)
    (fill,) = shard_map.fills
    assert (fill.local, fill.offset, fill.rows) == ("embedding.word_embeddings.weight", 70 * 32, 10)
    (embedding,) = [r for r in shard_map.regions if r.hf == "model.embed_tokens.weight"]
    assert (embedding.row, embedding.rows) == (80, 70)
    with pytest.raises(ValueError, match="cannot be split over 2"):
        layout_placements(model, at, padded_vocab=151)


def test_a_placement_the_name_map_disagrees_with_is_named():
    model = model_of("llama", kv_heads=2, tied=False)
    at = TrainerRank(tp_rank=0, tp_size=2)
    placements = layout_placements(model, at)
    proj = next(i for i, p in enumerate(placements) if p.name.endswith("linear_proj.weight"))
    wrong_dim = dataclasses.replace(placements[proj], partition_dim=0)
    with pytest.raises(ValueError, match="linear_proj.weight has partition_dim 0"):
        trainer_shard_map(model, [*placements[:proj], wrong_dim], 0, at)
    wrong_shape = dataclasses.replace(placements[proj], shape=(32, 32))
    with pytest.raises(ValueError, match=r"linear_proj.weight has local shape \(32, 32\)"):
        trainer_shard_map(model, [wrong_shape], 0, at)
    with pytest.raises(ValueError, match="has no rule"):
        trainer_shard_map(model, [ParamPlacement("decoder.layers.9.x", (1,), None)], 0, at)


@pytest.mark.parametrize(
    "example,layout",
    [
        ("tiny_cpu", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
        (
            "tiny_cpu_moe",
            {
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
                "expert_model_parallel_size": 2,
            },
        ),
        ("tiny_cpu_moe", {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    ],
)
def test_layout_placements_equal_megatrons_meta_shards(example, layout):
    model = load_config(REPO_ROOT / "examples" / example / "train.yaml").model
    parallel = dataclasses.replace(ParallelConfig(), **layout)
    world, tp = 4, parallel.tensor_model_parallel_size
    pp, ep = parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size
    for rank in range(world):
        with simulated.simulated_rank(parallel, world, rank) as context:
            chunks = simulated.build_meta_shard(model, parallel, context)
            read = chunk_placements(chunks)
        etp_rank, ep_rank, _ = simulated.expert_coordinates(parallel, world, rank)
        at = TrainerRank(
            tp_rank=rank % tp,
            tp_size=tp,
            pp_rank=rank // (world // pp),
            pp_size=pp,
            ep_rank=ep_rank,
            ep_size=ep,
            etp_rank=etp_rank,
        )
        assert sorted(read, key=lambda p: p.name) == sorted(
            layout_placements(model, at), key=lambda p: p.name
        ), f"rank {rank}"
        trainer_shard_map(model, read, rank, at)  # Megatron's shards agree with the name map
