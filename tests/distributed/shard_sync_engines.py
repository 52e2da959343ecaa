"""The engines of tests/distributed/shard_sync_worker.py, by ``--engine``: ``embedded`` (float32),
``vllm`` (in process, tensor parallel 2) or ``vllm-server`` (a client of the server at ``--url``,
started by the parent test)."""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_TP = 2
KEY_ENV = "VLLM_TEST_KEY"
"""Where a server's API key is given to the workers."""


def start(args, folder: Path):
    """The replica's engine on its engine rank, holding the HF folder's weights."""
    if args.engine == "embedded":
        from bapo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine.from_pretrained(folder)
    if args.engine == "vllm":
        from bapo_megatron.rollout.vllm.engine import VLLMEngine

        return VLLMEngine.from_pretrained(
            folder,
            tensor_parallel_size=ENGINE_TP,
            max_model_len=64,
            enforce_eager=True,
            kv_cache_gib=1,
        )
    if args.engine == "vllm-server":
        from bapo_megatron.config import ModelConfig
        from bapo_megatron.rollout.http import ApiKey
        from bapo_megatron.rollout.vllm.server_client import VLLMServerClient

        key = os.environ.get(KEY_ENV)
        return VLLMServerClient.connect(
            args.url,
            ModelConfig.from_hf_config(folder),
            weight_transport="process-group",
            api_key=None if key is None else ApiKey(key, KEY_ENV),
            timeout=120,
        )
    raise ValueError(f"unknown engine {args.engine!r}")


def stop(engine) -> None:
    if engine is not None and hasattr(engine, "close"):
        engine.close()
