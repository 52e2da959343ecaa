"""The HF <-> Megatron name maps, pure: one map per HF ``model_type`` with transformers' names and
shapes, and the maps' merge/split and tensor-parallel slicing against a plain per-head
construction of Megatron's layouts."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.config import MODEL_TYPES, ModelConfig
from bapo_megatron.models.name_maps import (
    NAME_MAPS,
    megatron_shape,
    merge,
    name_map_for,
    place_shard,
    split,
    tp_slice,
)
from bapo_megatron.weights.export import plan_buckets, rule_nbytes
from tests.helpers import hf_models

# ------------------------------------------------------------------------ name maps (pure)


def test_registry_is_keyed_by_model_type_and_refuses_unknown_ones():
    assert set(NAME_MAPS) == set(MODEL_TYPES)
    assert all(name_map.model_type == key for key, name_map in NAME_MAPS.items())
    with pytest.raises(ValueError, match=r"no name map for HF model_type 'mistral'.*'llama'"):
        name_map_for("mistral")


@pytest.mark.parametrize("variant", list(hf_models.VARIANTS))
def test_name_map_names_and_shapes_are_those_of_transformers(variant):
    hf = hf_models.build_hf_model(variant)
    model = read_model_config_from(hf)
    expected = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    if model.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the same matrix as the embedding; not saved
    assert name_map_for(model.model_type).hf_shapes(model) == expected


def read_model_config_from(hf_model: torch.nn.Module) -> ModelConfig:
    config = hf_model.config.to_dict()
    return ModelConfig.from_hf_config(config, rope_theta=config["rope_parameters"]["rope_theta"])


def megatron_qkv_reference(q, k, v, groups: int) -> torch.Tensor:
    """Megatron's fused q/k/v rows built head by head: per query group, its q heads, then k,
    then v (head size d = rows of k per group)."""
    d = k.shape[0] // groups
    per_group = q.shape[0] // d // groups
    rows = []
    for g in range(groups):
        rows += [q[(g * per_group + h) * d : (g * per_group + h + 1) * d] for h in range(per_group)]
        rows += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("heads,groups,tp", [(4, 2, 1), (4, 2, 2), (8, 2, 2), (4, 4, 4), (6, 1, 1)])
def test_qkv_merge_split_and_tp_slices_follow_megatron_layout(heads, groups, tp):
    d, hidden = 4, heads * 4
    model = ModelConfig(
        model_type="qwen2",
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=8,
        num_attention_heads=heads,
        num_query_groups=groups,
        vocab_size=8,
    )
    rules = {r.megatron: r for r in name_map_for("qwen2").rules(model)}
    gen = torch.Generator().manual_seed(0)
    for name in ("weight", "bias"):
        rule = rules[f"decoder.layers.0.self_attention.linear_qkv.{name}"]
        rest = (hidden,) if name == "weight" else ()
        q = torch.randn(heads * d, *rest, generator=gen)
        k, v = (torch.randn(groups * d, *rest, generator=gen) for _ in range(2))
        whole = megatron_qkv_reference(q, k, v, groups)
        assert torch.equal(merge(rule, [q, k, v], model), whole)
        assert all(torch.equal(a, b) for a, b in zip(split(rule, whole, model), (q, k, v)))
        # Megatron's TP shard of the fused tensor is a contiguous block of whole groups; it is
        # the merge of each rank's slices of q, k and v, and place_shard puts it back
        placed = [torch.zeros_like(t) for t in (q, k, v)]
        for rank in range(tp):
            slices = [t[tp_slice(rule, t.shape[0], rank, tp)] for t in (q, k, v)]
            shard = merge(rule, slices, model)
            assert torch.equal(shard, whole.chunk(tp)[rank])
            assert tuple(shard.shape) == megatron_shape(rule, model, tp)
            assert all(torch.equal(a, b) for a, b in zip(split(rule, shard, model), slices))
            place_shard(rule, placed, shard, rank, model)
        assert all(torch.equal(a, b) for a, b in zip(placed, (q, k, v)))


def test_gate_up_and_row_parallel_slices():
    model = ModelConfig(
        model_type="llama",
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=6,
        num_attention_heads=2,
        num_query_groups=2,
        vocab_size=8,
    )
    rules = {r.megatron: r for r in name_map_for("llama").rules(model)}
    fc1, fc2 = (
        rules["decoder.layers.0.mlp.linear_fc1.weight"],
        rules["decoder.layers.0.mlp.linear_fc2.weight"],
    )
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    assert torch.equal(merge(fc1, [gate, up], model), torch.cat([gate, up]))
    placed = [torch.zeros(6, 8), torch.zeros(6, 8), torch.zeros(8, 6)]
    for rank in range(2):  # rank r holds [gate_r; up_r] and the columns r of down
        shard = merge(fc1, [gate[tp_slice(fc1, 6, rank, 2)], up[tp_slice(fc1, 6, rank, 2)]], model)
        rows = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(shard, torch.cat([gate[rows], up[rows]]))
        assert torch.equal(down[:, tp_slice(fc2, 6, rank, 2)], down[:, 3 * rank : 3 * rank + 3])
        place_shard(fc1, placed[:2], shard, rank, model)
        place_shard(fc2, placed[2:], down[:, 3 * rank : 3 * rank + 3], rank, model)
    assert all(torch.equal(a, b) for a, b in zip(placed, (gate, up, down)))
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 4"):
        tp_slice(fc1, 6, 0, 4)


def test_bucket_plan_keeps_order_and_bound():
    model = read_model_config_from(hf_models.build_hf_model("qwen2-tied"))
    rules = name_map_for("qwen2").rules(model)
    exported = [r for r in rules if r.exported]
    assert len(exported) == len(rules) - 1  # the tied output layer is not exported
    bound = 40_000
    buckets = plan_buckets(rules, model, bound, element_size=4)
    assert [r for bucket in buckets for r in bucket] == exported
    sizes = [sum(rule_nbytes(r, model, 4) for r in bucket) for bucket in buckets]
    assert all(size <= bound or len(bucket) == 1 for size, bucket in zip(sizes, buckets))
    assert any(size > bound for size in sizes)  # the 32 KB embedding + ... forces a lone bucket
    # greedy: the next bucket's first rule did not fit
    assert all(
        sizes[i] + rule_nbytes(buckets[i + 1][0], model, 4) > bound for i in range(len(buckets) - 1)
    )
    assert len(plan_buckets(rules, model, 1, 4)) == len(exported)
