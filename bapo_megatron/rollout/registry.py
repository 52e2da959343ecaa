"""Build the rollout engine a run's configuration names (``rollout.engine``).

Only the embedded engine runs on these machines; vLLM and SGLang are imported here, lazily, on
the ranks that hold an engine, and need their packages installed (docs/rollout-engines.md).
"""

from __future__ import annotations

from pathlib import Path

from bapo_megatron.config import ModelConfig, RolloutConfig
from bapo_megatron.rollout.guard import EngineFailure, GuardedEngine
from bapo_megatron.rollout.protocol import RolloutEngine


def build_engine(rollout: RolloutConfig, model: ModelConfig, *, model_path: str | None,
                 dp_rank: int, work_dir: Path, pad_token_id: int) -> RolloutEngine:
    """The engine of data-parallel replica ``dp_rank``. ``model_path`` is the HF folder the run
    started from (vLLM and SGLang load their first weights, and their tokenizer-free config,
    from it; the trainer pushes its own weights before the first rollout anyway).
    ``work_dir`` is where engines that take weights from disk (the vLLM server) get them.
    The engine comes guarded: its failures name it, and generation has ``rollout.timeout_s``."""
    name = f"rollout engine {rollout.engine!r} of data-parallel replica {dp_rank}"
    url = None
    if rollout.engine.endswith("-server"):
        urls = rollout.server_urls
        if len(urls) > 1 and len(urls) <= dp_rank:
            raise ValueError(f"rollout.server_urls has {len(urls)} entries; data-parallel rank "
                             f"{dp_rank} has none (give one per data-parallel rank, or one)")
        url = urls[dp_rank] if len(urls) > 1 else urls[0]
        name += f" at {url}"
    try:
        engine = _start_engine(rollout, model, model_path=model_path, url=url, dp_rank=dp_rank,
                               work_dir=work_dir, pad_token_id=pad_token_id)
    except Exception as error:
        raise EngineFailure(f"{name} could not start: {type(error).__name__}: {error}") from error
    return GuardedEngine(engine, name=name, timeout_s=rollout.timeout_s)


def _start_engine(rollout: RolloutConfig, model: ModelConfig, *, model_path: str | None,
                  url: str | None, dp_rank: int, work_dir: Path, pad_token_id: int) -> RolloutEngine:
    kind = rollout.engine
    http_timeout = rollout.timeout_s or 3600.0
    if kind == "embedded":
        from bapo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine(model, pad_token_id=pad_token_id)
    if kind in ("vllm-server", "sglang-server"):
        if kind == "vllm-server":
            from bapo_megatron.rollout.vllm.server_client import VLLMServerClient

            return VLLMServerClient.connect(url, model, weights_dir=work_dir / f"vllm_weights_dp{dp_rank}",
                                          timeout=http_timeout)
        from bapo_megatron.rollout.sglang.engine import SGLangEngine
        from bapo_megatron.rollout.sglang.server_client import SGLangHTTPClient

        return SGLangEngine(SGLangHTTPClient(url, tp_size=rollout.engine_tensor_parallel_size,
                                             timeout=http_timeout), model,
                            bucket_bytes=rollout.weight_bucket_mib * 2**20)
    if model_path is None:
        raise ValueError(f"rollout.engine={kind!r} starts from an HF folder: set train.model_path")
    dtype = "bfloat16" if model.params_dtype == "bfloat16" else "float32"
    if kind == "vllm":
        from bapo_megatron.rollout.vllm.engine import VLLMEngine

        return VLLMEngine.from_pretrained(model_path, dtype=dtype,
                                          tensor_parallel_size=rollout.engine_tensor_parallel_size,
                                          gpu_memory_utilization=rollout.gpu_memory_utilization,
                                          max_model_len=model.max_position_embeddings,
                                          enable_sleep_mode=True)
    from bapo_megatron.rollout.sglang.engine import SGLangEngine

    return SGLangEngine.in_process(model_path, dtype=dtype, tp_size=rollout.engine_tensor_parallel_size,
                                   mem_fraction_static=rollout.gpu_memory_utilization)
