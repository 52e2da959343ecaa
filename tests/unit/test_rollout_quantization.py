"""FP8 rollout (``rollout.quantization``): refused where it cannot run (engines other than
in-process vLLM/SGLang, a CPU run, a CPU vLLM), and passed on as vLLM's and SGLang's own
``quantization`` argument, against stand-ins of their APIs (the real FP8 engine runs on a GPU
only: docs/validation.md)."""

from __future__ import annotations

import json
import sys
import types

import pytest

import bapo_megatron.rollout.sglang as sglang_family
import bapo_megatron.rollout.vllm as vllm_family
from bapo_megatron.config import ModelConfig, RolloutConfig, check_training, load_config
from bapo_megatron.rollout.engine_setup import EngineSetup
from bapo_megatron.rollout.sglang.engine import SGLangEngine
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from tests.helpers.gloo_launch import REPO_ROOT

MODEL = ModelConfig(
    model_type="qwen2",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=2,
    num_query_groups=1,
    vocab_size=128,
    tie_word_embeddings=True,
)


def test_only_in_process_vllm_and_sglang_take_a_quantization():
    for engine in ("vllm", "sglang"):
        assert RolloutConfig(engine=engine, quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match=r"rollout.quantization='fp8' applies to the in-process "
                       r"engines \['vllm', 'sglang'\]; rollout.engine='embedded'"):
        RolloutConfig(quantization="fp8")
    with pytest.raises(ValueError, match="start the server with --quantization instead"):
        RolloutConfig(engine="vllm-server", server_urls=("http://h:1",), quantization="fp8")
    with pytest.raises(ValueError, match=r"rollout.quantization must be one of \['fp8'\] or null"):
        RolloutConfig(engine="vllm", quantization="int4")


def test_a_cpu_run_refuses_a_quantized_engine():
    config = REPO_ROOT / "examples" / "tiny_cpu" / "train.yaml"
    base = ["rollout.engine=vllm", "rollout.quantization=fp8", "warmup.steps=0"]
    with pytest.raises(ValueError, match=r"rollout.quantization='fp8' needs the engine on a CUDA "
                       r"GPU with FP8, but parallel.device is 'cpu'"):
        check_training(load_config(config, [*base, "parallel.device=cpu"]))


def _setup(engine: str, quantization: str | None, tmp_path) -> EngineSetup:
    return EngineSetup(
        rollout=RolloutConfig(engine=engine, quantization=quantization),
        model=MODEL, model_path=str(tmp_path), url=None, dp_rank=0, work_dir=tmp_path,
        pad_token_id=0, device="cuda:0",
    )


@pytest.mark.parametrize("quantization", ["fp8", None])
def test_the_builders_pass_the_quantization_on(monkeypatch, tmp_path, quantization):
    seen = {}

    def capture(cls, folder, **kwargs):
        seen.update(kwargs)
        return "engine"

    monkeypatch.setattr(VLLMEngine, "from_pretrained", classmethod(capture))
    monkeypatch.setattr(SGLangEngine, "in_process", classmethod(capture))
    monkeypatch.setattr(sglang_family.torch.cuda, "current_device", lambda: 0)
    want = {"quantization": quantization} if quantization else {}
    for family, engine in ((vllm_family, "vllm"), (sglang_family, "sglang")):
        seen.clear()
        assert family.start_in_process(_setup(engine, quantization, tmp_path)) == "engine"
        assert {k: v for k, v in seen.items() if k == "quantization"} == want


class FakeLLM:
    """What ``VLLMEngine.from_pretrained`` touches of ``vllm.LLM``."""

    started: dict = {}

    def __init__(self, **kwargs):
        FakeLLM.started = kwargs
        scheduler = types.SimpleNamespace(enable_chunked_prefill=True)
        self.llm_engine = types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(scheduler_config=scheduler)
        )

    def collective_rpc(self, method, args=()):
        return [True]


def _fake_vllm(monkeypatch, on_cpu: bool) -> None:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: on_cpu)
    envs = types.ModuleType("vllm.envs")
    envs.disable_envs_cache = lambda: None
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


def test_vllm_gets_the_quantization_on_a_gpu_and_refuses_it_on_a_cpu(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MODEL.to_hf_config()))
    _fake_vllm(monkeypatch, on_cpu=False)
    FakeLLM.started = {}
    engine = VLLMEngine.from_pretrained(tmp_path, dtype="bfloat16", quantization="fp8")
    assert FakeLLM.started["quantization"] == "fp8" and engine.version == 0
    VLLMEngine.from_pretrained(tmp_path, dtype="bfloat16")
    assert "quantization" not in FakeLLM.started

    _fake_vllm(monkeypatch, on_cpu=True)
    FakeLLM.started = {}
    with pytest.raises(ValueError, match=r"rollout.quantization='fp8': this vLLM runs on the "
                       "CPU, whose build has no FP8 kernels"):
        VLLMEngine.from_pretrained(tmp_path, quantization="fp8")
    assert FakeLLM.started == {}  # refused before vLLM started
