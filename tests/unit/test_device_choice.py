"""Which device a run computes on (``parallel.device``, ``BAPO_DEVICE``), checked with CUDA faked
where it matters: a CPU run on a machine with a GPU must take the CPU path everywhere (gloo, the
CPU patches, CPU initialization, unbatched p2p), and nothing may ask torch whether a GPU exists
in its place."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.actor.megatron_config import to_transformer_config
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.device import DEVICE_ENV, resolve_device
from bapo_megatron.distributed.layout import Accelerator

TINY = ModelConfig(
    model_type="llama",
    num_layers=2,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
)


@pytest.fixture
def gpu_machine(monkeypatch):
    """torch reports a GPU (nothing may actually use it: the calls that would are refused)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv(DEVICE_ENV, raising=False)


def test_auto_follows_the_machine_and_the_environment(monkeypatch, gpu_machine):
    assert resolve_device("auto") == "cuda"
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cuda") == "cuda"  # a configuration that names one wins
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match=r"environment variable BAPO_DEVICE must be `cpu` or"):
        resolve_device("auto")


def test_cuda_without_a_gpu_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match=r"parallel.device is `cuda`, but torch sees no CUDA"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"parallel.device must be `cpu` or `cuda`, got 'tpu'"):
        resolve_device("tpu")


def test_a_cpu_run_on_a_gpu_machine_configures_megatron_for_the_cpu(gpu_machine):
    cpu = to_transformer_config(TINY, ParallelConfig(device="cpu"))
    assert cpu.use_cpu_initialization and not cpu.batch_p2p_comm
    assert Accelerator.detect("cpu").cuda is False
    gpu = to_transformer_config(TINY, ParallelConfig(device="cuda"))
    assert not gpu.use_cpu_initialization and gpu.batch_p2p_comm
    assert Accelerator.detect("cuda") == Accelerator(
        transformer_engine=Accelerator.detect("cuda").transformer_engine, cuda=True, fp8_gpu=True
    )


def test_a_cpu_run_on_a_gpu_machine_uses_gloo_and_the_cpu_patches(gpu_machine):
    context = ParallelContext.initialize(ParallelConfig(device="cpu"))
    try:
        assert context.device == torch.device("cpu")
        assert torch.distributed.get_backend() == "gloo"
        assert torch.cuda.current_device() == "cpu"  # the CPU patches are in place
    finally:
        context.teardown()


def test_deterministic_mode_is_set_for_the_run_and_undone_at_teardown():
    assert not torch.are_deterministic_algorithms_enabled()
    context = ParallelContext.initialize(ParallelConfig(device="cpu", deterministic=True))
    try:
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        context.teardown()
    assert not torch.are_deterministic_algorithms_enabled()
