"""The one name map (bapo_megatron/models/name_maps.py) on Transformer Engine's parameter names,
without TE: a stand-in model whose parameters carry the names TE's layer specs give them (the
pre-norm weights fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``; an MoE
layer keeps its own ``pre_mlp_layernorm``) maps to exactly the name map's parameters, and so to
HF's names and back. A dense Qwen2 with TE's names is also exported and loaded for real
(tests/unit/test_weights_convert.py); the TE pass of the GPU check runs the layers
(docs/validation.md)."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.config.moe import MoeConfig
from bapo_megatron.models.name_maps import (
    TE_NAME_ALIASES,
    chunk_parameters,
    megatron_shape,
    name_map_for,
)

QWEN3_MOE = ModelConfig(
    model_type="qwen3_moe",
    num_layers=3,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    vocab_size=64,
    moe=MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,)
    ),
)
QWEN2 = ModelConfig(
    model_type="qwen2",
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    tie_word_embeddings=True,
)
TE_NAMES = {local: te for te, local in TE_NAME_ALIASES.items()}


def te_name(megatron: str, sparse: bool) -> str:
    """The name TE's spec gives the parameter the name map calls ``megatron``."""
    if not megatron.startswith("decoder.layers."):
        return megatron
    prefix, suffix = megatron.split(".", 3)[:3], megatron.split(".", 3)[3]
    if suffix in TE_NAMES and not (sparse and suffix == "pre_mlp_layernorm.weight"):
        suffix = TE_NAMES[suffix]
    return ".".join([*prefix, suffix])


def fake_te_chunk(model: ModelConfig, ep_rank: int = 0, ep_size: int = 1) -> torch.nn.Module:
    """A module tree holding, under TE's names, one parameter per rule of the name map, with
    expert-parallel rank ``ep_rank``'s experts only, numbered locally as Megatron does."""
    name_map = name_map_for(model.model_type)
    sparse = (
        model.moe.moe_layer_pattern(model.num_layers) if model.moe else [False] * model.num_layers
    )
    root = torch.nn.Module()
    root.decoder = torch.nn.Module()
    root.decoder.layers = torch.nn.ModuleList()
    for i in range(model.num_layers):
        layer = torch.nn.Module()
        layer.layer_number = i + 1
        root.decoder.layers.append(layer)
    per_rank = model.moe.num_experts // ep_size if model.moe else 0
    expert_offset = ep_rank * per_rank
    for rule in name_map.rules(model):
        if not rule.exported:
            continue
        if rule.expert is not None and not 0 <= rule.expert - expert_offset < per_rank:
            continue
        layer_index = (
            int(rule.megatron.split(".")[2])
            if rule.megatron.startswith("decoder.layers.")
            else None
        )
        name = te_name(rule.megatron, layer_index is not None and sparse[layer_index])
        if rule.expert is not None:
            name = name.replace(
                f"local_experts.{rule.expert}.", f"local_experts.{rule.expert - expert_offset}."
            )
        module = root
        *path, leaf = name.split(".")
        for part in path:
            if part.isdigit():
                module = module[int(part)]
                continue
            if not hasattr(module, part):
                setattr(
                    module,
                    part,
                    torch.nn.ModuleList() if part == "local_experts" else torch.nn.Module(),
                )
            module = getattr(module, part)
            if part == "local_experts":
                while len(module) <= int(name.split("local_experts.")[1].split(".")[0]):
                    module.append(torch.nn.Module())
        module.register_parameter(
            leaf, torch.nn.Parameter(torch.zeros(megatron_shape(rule, model)))
        )
    for layer, is_sparse in zip(root.decoder.layers, sparse):
        if is_sparse:
            count = len(layer.mlp.experts.local_experts)
            layer.mlp.local_expert_indices = list(range(expert_offset, expert_offset + count))
    return root


@pytest.mark.parametrize("model", [QWEN3_MOE, QWEN2], ids=["qwen3_moe", "qwen2"])
def test_te_names_map_to_the_name_maps_parameters_and_hf_names(model):
    chunk = fake_te_chunk(model)
    raw = {name for name, _ in chunk.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in raw
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in raw
    rules = {r.megatron: r for r in name_map_for(model.model_type).rules(model) if r.exported}
    mapped = dict(chunk_parameters(chunk))
    assert set(mapped) == set(rules)  # every TE name has its rule, no rule is left over
    assert all(tuple(p.shape) == megatron_shape(rules[n], model) for n, p in mapped.items())
    hf_names = [hf for name in mapped for hf in rules[name].hf]
    assert sorted(hf_names) == sorted(name_map_for(model.model_type).hf_shapes(model))
    # and back: every HF tensor names one rule, whose parameter has a TE name in the chunk
    by_hf = {hf: r.megatron for r in rules.values() for hf in r.hf}
    sparse = (
        model.moe.moe_layer_pattern(model.num_layers) if model.moe else [False] * model.num_layers
    )
    for hf, megatron in by_hf.items():
        layer = int(megatron.split(".")[2]) if megatron.startswith("decoder.layers.") else 0
        assert te_name(megatron, sparse[layer]) in raw, hf
    if model.is_moe:  # the MoE layer's norm is its own module under TE too
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in raw


def test_an_expert_parallel_ranks_local_experts_get_their_global_numbers():
    chunk = fake_te_chunk(QWEN3_MOE, ep_rank=1, ep_size=2)
    names = {name for name, _ in chunk_parameters(chunk)}
    experts = {n.split("local_experts.")[1].split(".")[0] for n in names if "local_experts" in n}
    assert experts == {"2", "3"}
    local = {name for name, _ in chunk.named_parameters() if "local_experts" in name}
    assert {n.split("local_experts.")[1].split(".")[0] for n in local} == {"0", "1"}
