"""Optimizer CPU offload (``optimizer.cpu_offload_fraction``): the configuration's checks, the
refusal on a CPU run, the settings handed to Megatron, and the layout planner's accounting (the
offloaded share's moments leave the GPU, the host holds 16 bytes per offloaded element, summed
per node). Megatron's offloading optimizer itself is CUDA-only and never runs here."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer

import bapo_megatron.actor.optimizer as actor_optimizer
from bapo_megatron.actor.optimizer import build_optimizer, require_offload_support
from bapo_megatron.config import Config, OptimizerConfig, ParallelConfig
from bapo_megatron.config.loading import load_config
from bapo_megatron.planning.plan import plan_layout
from bapo_megatron.planning.shard_memory import (
    HOST_OPTIMIZER_BYTES,
    ActorStateBytes,
    actor_state_bytes,
    offload_optimizer,
)
from tests.unit.test_moe_planner import CPU, MODEL

OFFLOADED = OptimizerConfig(use_distributed_optimizer=True, cpu_offload_fraction=0.5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optimizer.cpu_offload_fraction=1.5"], "optimizer.cpu_offload_fraction must lie in"),
        (["optimizer.cpu_offload_fraction=-0.1"], "optimizer.cpu_offload_fraction must lie in"),
        (["optimizer.cpu_offload_fraction=.nan"], "optimizer.cpu_offload_fraction must lie in"),
        (
            ["optimizer.cpu_offload_fraction=0.5"],
            "optimizer.cpu_offload_fraction=0.5 needs optimizer.use_distributed_optimizer: true",
        ),
    ],
)
def test_bad_offload_settings_name_the_fields(overrides, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_offload_settings_load():
    cfg = load_config(
        None,
        [
            "optimizer.use_distributed_optimizer=true",
            "optimizer.cpu_offload_fraction=1",
            "optimizer.overlap_cpu_offload=false",
        ],
    )
    assert cfg.optimizer.cpu_offload_fraction == 1.0 and not cfg.optimizer.overlap_cpu_offload
    assert OptimizerConfig().cpu_offload_fraction == 0.0  # off unless asked for


def test_a_cpu_run_refuses_offload_before_building_anything():
    context = SimpleNamespace(config=ParallelConfig(device="cpu"))
    with pytest.raises(ValueError) as raised:
        build_optimizer([], OFFLOADED, torch.bfloat16, context)
    message = str(raised.value)
    assert "optimizer.cpu_offload_fraction=0.5 needs a CUDA run" in message
    assert "HybridDeviceOptimizer" in message and "'cpu'" in message
    # without offload the CPU is fine
    require_offload_support(dataclasses.replace(OFFLOADED, cpu_offload_fraction=0.0), "cpu")


def test_offload_without_te_or_apex_is_refused_as_it_could_not_resume(monkeypatch):
    """Found on a GPU without TE: the checkpoints of an offloading run save but never load."""
    monkeypatch.setattr(actor_optimizer, "uses_cuda", lambda device: True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    with pytest.raises(ValueError) as raised:
        require_offload_support(OFFLOADED, "cuda")
    assert "needs Transformer Engine or Apex" in str(raised.value)
    assert "could not resume" in str(raised.value)
    require_offload_support(dataclasses.replace(OFFLOADED, cpu_offload_fraction=0.0), "cuda")
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    require_offload_support(OFFLOADED, "cuda")


@pytest.mark.parametrize("fraction,overlap", [(0.5, False), (0.0, True)])
def test_offload_settings_reach_megatron(monkeypatch, fraction, overlap):
    """What build_optimizer asks Megatron for, caught where Megatron would build it (the check
    for CUDA is told it runs on one)."""
    seen = {}

    class Built(Exception):
        pass

    def catch(config, *args, **kwargs):
        seen["config"] = config
        raise Built

    monkeypatch.setattr(actor_optimizer, "uses_cuda", lambda device: True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)  # a GPU image with TE
    monkeypatch.setattr(actor_optimizer, "get_megatron_optimizer", catch)
    optimizer = dataclasses.replace(
        OFFLOADED, cpu_offload_fraction=fraction, overlap_cpu_offload=overlap
    )
    context = SimpleNamespace(config=ParallelConfig(device="cuda"), process_groups=None)
    with pytest.raises(Built):
        build_optimizer([], optimizer, torch.bfloat16, context)
    config = seen["config"]
    assert config.optimizer_cpu_offload is (fraction > 0)
    assert config.optimizer_offload_fraction == fraction
    assert config.overlap_cpu_optimizer_d2h_h2d is overlap
    assert config.use_distributed_optimizer and config.decoupled_weight_decay  # Megatron needs


def test_offload_moves_the_moments_of_the_fraction_by_hand():
    # 1000 bf16 elements: fp32 main weight (4) + two moments (8) each on the GPU.
    state = ActorStateBytes(
        parameters=1000,
        weights=2000,
        gradients=4000,
        optimizer=12000,
        optimizer_replicated=12000,
        optimizer_distributed=12000,
        optimized=1000,
    )
    assert offload_optimizer(state, 0.0) == state
    quarter = offload_optimizer(state, 0.25)
    assert (quarter.optimizer, quarter.optimizer_host) == (12000 - 250 * 8, 250 * 16)
    whole = offload_optimizer(state, 1.0)
    assert (whole.optimizer, whole.optimizer_host) == (4000, 16000)  # the main weights stay
    assert whole.weights == 2000 and whole.gradients == 4000 and whole.total == 10000
    assert HOST_OPTIMIZER_BYTES == 16  # moments, main-weight copy, gradient copy
    # whole elements, rounded up
    assert offload_optimizer(dataclasses.replace(state, optimized=3), 0.5).optimizer_host == 32


@pytest.mark.parametrize("distributed", [False, True])
def test_optimized_elements_are_those_the_optimizer_updates(distributed):
    with torch.device("meta"):
        module = torch.nn.Linear(64, 32, dtype=torch.bfloat16)  # 2080 elements
    total = sum(p.numel() for p in module.parameters())
    shards = [actor_state_bytes([module], 2, rank, distributed) for rank in (0, 1)]
    if distributed:  # each data-parallel rank updates its half
        assert sum(s.optimized for s in shards) == total
    else:
        assert all(s.optimized == total for s in shards)
    assert all(s.optimizer == 12 * s.optimized for s in shards)


def test_planner_counts_the_offloaded_state_per_rank_and_per_node():
    parallel = ParallelConfig(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2
    )
    plans = {
        fraction: plan_layout(
            Config(
                parallel=parallel,
                optimizer=dataclasses.replace(OFFLOADED, cpu_offload_fraction=fraction),
            ),
            MODEL,
            8,
            accelerator=CPU,
            gpus_per_node=4,
        )
        for fraction in (0.0, 0.3, 1.0)
    }
    assert not any(plan.problems for plan in plans.values())
    without = plans[0.0]
    assert all(m.optimizer_host == 0 for m in without.memory)
    assert without.host_bytes_per_node == [0, 0]
    for fraction in (0.3, 1.0):
        plan = plans[fraction]
        for off, on in zip(without.memory, plan.memory, strict=True):
            # bf16 model: 12 bytes per optimized element; the dense part and the experts are
            # offloaded by optimizers of their own, each rounding up
            dense = (off.optimizer - off.expert_optimizer) // 12
            experts = off.expert_optimizer // 12
            moved = math.ceil(dense * fraction) + math.ceil(experts * fraction)
            assert on.optimizer == off.optimizer - 8 * moved
            assert on.expert_optimizer == off.expert_optimizer - 8 * math.ceil(experts * fraction)
            assert on.optimizer_host == 16 * moved
            assert on.total == off.total - 8 * moved  # the host share is not GPU memory
            assert (on.weights, on.gradients) == (off.weights, off.gradients)
            assert (on.optimizer_distributed, on.optimizer_replicated) == (
                off.optimizer_distributed,
                off.optimizer_replicated,
            )
        # ranks 0-3 on node 0, 4-7 on node 1
        assert plan.host_bytes_per_node == [
            sum(m.optimizer_host for m in plan.memory if m.rank // 4 == node) for node in (0, 1)
        ]
        assert plan.summary()["host_optimizer_gb_per_node"] == [
            round(b / 1e9, 2) for b in plan.host_bytes_per_node
        ]
    # everything offloaded: only the fp32 main weights (a third of the state) stay on the GPU
    assert [m.optimizer for m in plans[1.0].memory] == [m.optimizer // 3 for m in without.memory]
