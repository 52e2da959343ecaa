"""Shard maps from observed elements (bapo_megatron/models/shard_probe.py): stand-ins written as a
loader following vLLM's described split would write them, read back, give that description's
regions and fills exactly; values a loader changed are refused, naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from bapo_megatron.config import ModelConfig
from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.shard_map import ShardMap, matrix_shape
from bapo_megatron.models.shard_probe import UNWRITTEN, mark_replicated, observed_parts, rectangles
from bapo_megatron.models.vllm_shards import vllm_shard_map


def model_of(family: str, kv_heads: int) -> ModelConfig:
    moe = None
    if family == "qwen3_moe":
        moe = MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    return ModelConfig(
        model_type=family,
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=24,
        num_attention_heads=8,
        num_query_groups=kv_heads,
        head_dim=8 if family.startswith("qwen3") else None,
        vocab_size=150,  # padded to 192 by vLLM: fills on the last worker
        tie_word_embeddings=family == "qwen2",
        moe=moe,
    )


def observed(described: ShardMap, shapes) -> ShardMap:
    """``described`` rebuilt from stand-ins written the way it says, one HF tensor at a time."""
    locals_ = described.shapes()
    regions, fills = [], []
    for hf, hf_shape in shapes.items():
        _, hf_cols = matrix_shape(hf_shape)
        parts = [r for r in described.regions if r.hf == hf]
        for local in sorted({r.local for r in parts}):
            values = np.full(int(np.prod(locals_[local])), UNWRITTEN)
            for region in parts:
                if region.local == local:
                    values[region.local_indices()] = region.hf_indices(hf_cols) + 1
            for fill in described.fills:
                if fill.local == local:
                    values[fill.local_indices()] = 0
            found, filled = observed_parts(hf, hf_shape, local, values.reshape(locals_[local]))
            regions.extend(found)
            fills.extend(f for f in filled if f not in fills)
    return ShardMap(described.rank, tuple(regions), tuple(fills), described.local_shapes)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 1), (2, 2), (2, 4), (4, 2), (1, 4)])
def test_observed_elements_give_the_described_maps(family, kv_heads, tp):
    model = model_of(family, kv_heads)
    shapes = name_map_for(family).hf_shapes(model)
    described = [vllm_shard_map(model, r, tp, r) for r in range(tp)]
    rebuilt = mark_replicated([observed(m, shapes) for m in described], shapes)
    for want, got in zip(described, rebuilt):
        assert sorted(got.regions) == sorted(want.regions)
        assert sorted(got.fills) == sorted(want.fills)
    assert rebuilt[-1].fills  # the padded vocabulary


def test_runs_at_changing_strides_become_separate_rectangles():
    # HF rows 0..3 of 2 columns, at local offsets 0, 4, 8 then 20
    local = np.array([0, 1, 4, 5, 8, 9, 20, 21])
    source = np.arange(8)
    assert rectangles(local, source, 2) == [(0, 0, 3, 2, 0, 4), (3, 0, 1, 2, 20, 2)]


def test_a_loader_that_changes_values_is_named():
    values = np.full(6, UNWRITTEN)
    values[:3] = np.array([1.0, 2.0, 3.0]) * 0.5  # scaled on the way in
    with pytest.raises(ValueError, match="loading 'w'.*changes values"):
        observed_parts("w", (3, 2), "local.w", values)
