"""The engines of tests/distributed/shard_sync_worker.py, by ``--engine``: ``embedded`` (float32),
``vllm`` (in process, tensor parallel 2; ``vllm-tp1``: one worker, in the rank's process) or
``vllm-server`` (a client of the server at ``--url``, started by the parent test)."""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_TP = 2
KEY_ENV = "VLLM_TEST_KEY"
"""Where a server's API key is given to the workers."""


def start(kind: str, url: str, folder: Path):
    """The replica's engine of ``kind`` on its engine rank, holding the HF folder's weights."""
    if kind == "embedded":
        from bapo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine.from_pretrained(folder)
    if kind in ("vllm", "vllm-tp1"):
        from bapo_megatron.rollout.vllm.engine import VLLMEngine

        engine = VLLMEngine.from_pretrained(
            folder,
            tensor_parallel_size=tensor_parallel_size(kind),
            max_model_len=64,
            enforce_eager=True,
            kv_cache_gib=1,
        )
        load = engine._load_weights

        def kept(tensors, **kwargs):  # the broadcast path's tensors, for a reference model
            engine.last_loaded = {name: tensor.clone() for name, tensor in tensors}
            return load(iter(engine.last_loaded.items()), **kwargs)

        engine._load_weights = kept
        return engine
    if kind == "vllm-server":
        from bapo_megatron.config import ModelConfig
        from bapo_megatron.rollout.http import ApiKey
        from bapo_megatron.rollout.vllm.server_client import VLLMServerClient

        key = os.environ.get(KEY_ENV)
        return VLLMServerClient.connect(
            url,
            ModelConfig.from_hf_config(folder),
            weight_transport="process-group",
            api_key=None if key is None else ApiKey(key, KEY_ENV),
            timeout=120,
        )
    raise ValueError(f"unknown engine {kind!r}")


def stop(engine) -> None:
    if engine is not None and hasattr(engine, "close"):
        engine.close()


def tensor_parallel_size(kind: str) -> int:
    return 1 if kind == "vllm-tp1" else ENGINE_TP


def probed(engine, kind: str) -> bool:
    """An in-process vLLM's maps read off its loaders equal the described ones (raises if not,
    tests/helpers/vllm_shard_checks.py), a padded vocabulary's rows being the last worker's
    fills."""
    from tests.helpers.vllm_shard_checks import check_engine_shard_maps

    maps = check_engine_shard_maps(engine, tensor_parallel_size(kind))
    if engine.model_config.vocab_size % 64:
        assert maps[-1].fills
        vocab = {"model.embed_tokens.weight", "lm_head.weight"}
        assert {fill.local for fill in maps[-1].fills} <= vocab
    return True
