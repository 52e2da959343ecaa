"""The planner's meta shards (bapo_megatron/planning/simulated_rank.py): with the full-matrix CPU
initialization reduced to the tensor-parallel attributes, a rank's meta shard is the shard
Megatron's own initialization builds, parameter for parameter: names, shapes, dtypes and every
tensor-parallel attribute, at a tensor-parallel layout of a dense and a mixture-of-experts model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bapo_megatron.config import ParallelConfig
from bapo_megatron.config.loading import load_config
from bapo_megatron.planning import simulated_rank as simulated
from tests.helpers.gloo_launch import REPO_ROOT

ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce")


def described(chunks) -> list[tuple]:
    return [
        (name, tuple(p.shape), p.dtype, p.device.type)
        + tuple(getattr(p, attribute, None) for attribute in ATTRIBUTES)
        for chunk in chunks
        for name, p in chunk.named_parameters()
    ]


def shard(model, parallel, world_size, rank, fast: bool):
    with simulated.simulated_rank(parallel, world_size, rank) as context:
        if fast:
            return described(simulated.build_meta_shard(model, parallel, context))
        with torch.device(simulated.META):  # Megatron's own initialization on the meta device
            return described(simulated.build_model(model, parallel, context, initialize=False))


@pytest.mark.parametrize(
    "example,layout",
    [
        ("tiny_cpu", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
        (
            "tiny_cpu_moe",
            {
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
                "expert_model_parallel_size": 2,
            },
        ),
    ],
)
def test_meta_shard_equals_megatrons_own_initialization(example, layout):
    model = load_config(REPO_ROOT / "examples" / example / "train.yaml").model
    parallel = dataclasses.replace(ParallelConfig(), **layout)
    for rank in (0, 1, 3):
        fast = shard(model, parallel, 4, rank, fast=True)
        assert fast == shard(model, parallel, 4, rank, fast=False)
        assert any(entry[4] for entry in fast), "no tensor-parallel weight in the shard"
        assert all(entry[3] == "meta" for entry in fast)


def test_weights_off_the_meta_device_take_megatrons_function(monkeypatch):
    from megatron.core.tensor_parallel import layers

    calls = []

    def megatrons(weight, output_size, input_size, per_partition_size, partition_dim,
                  init_method, stride=1, return_master_weight=False, *,
                  params_dtype=torch.float32, rank=None, world_size=None,
                  skip_set_tensor_parallel_attributes=False):  # fmt: skip
        calls.append(weight)

    monkeypatch.setattr(layers, "_initialize_affine_weight_cpu", megatrons)
    with simulated.meta_weights_skip_the_full_matrix():
        weight = torch.empty(4, 3)
        layers._initialize_affine_weight_cpu(weight, 8, 3, 4, 0, None)
        meta = torch.empty(4, 3, device="meta")
        master = layers._initialize_affine_weight_cpu(
            meta, 8, 3, 4, 0, None, return_master_weight=True
        )
    assert len(calls) == 1 and calls[0] is weight
    assert meta.tensor_model_parallel and meta.partition_dim == 0 and meta.partition_stride == 1
    assert master.shape == (8, 3) and master.device.type == "meta"
    assert layers._initialize_affine_weight_cpu is megatrons  # restored on exit
