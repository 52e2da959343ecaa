"""vLLM: the in-process engine (``vllm.LLM``), the OpenAI-compatible server client, and the
worker extension both load.

The family's builders for :mod:`bapo_megatron.rollout.registry` live here. The adapters import
vllm only when an engine starts, so registering the family does not need it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from bapo_megatron.rollout.http import check_server_answers, rollout_api_key
from bapo_megatron.rollout.vllm.engine import VLLMEngine
from bapo_megatron.rollout.vllm.kv_cache_size import engine_context
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from bapo_megatron.rollout.vllm.tensor_parallel import (
    executor_backend,
    process_world_size,
    worker_gpus,
)

if TYPE_CHECKING:
    from bapo_megatron.rollout.engine_setup import EngineSetup
    from bapo_megatron.rollout.protocol import RolloutEngine

FAMILY = "vllm"
"""Its ``rollout.engine`` kinds: ``vllm`` (in process) and ``vllm-server``."""


def start_in_process(setup: EngineSetup) -> RolloutEngine:
    """``vllm.LLM`` in this process on the run's HF folder, sized by the rollout settings: its
    context and CPU KV cache those of one rollout batch
    (:func:`~bapo_megatron.rollout.vllm.kv_cache_size.engine_context`; ``VLLM_CPU_KVCACHE_SPACE``
    overrides the cache, ``train.max_position_embeddings`` bounds the context). At
    ``rollout.engine_tensor_parallel_size`` N > 1 on GPUs its N workers take N GPUs of the node
    from this rank's own (:func:`engine_worker_gpus`)."""

    rollout = setup.rollout
    sized = engine_context(
        rollout,
        setup.model,
        dtype=setup.engine_dtype,
        tensor_parallel_size=rollout.engine_tensor_parallel_size,
        longest_prompt_tokens=setup.longest_prompt_tokens,
    )
    return VLLMEngine.from_pretrained(
        setup.hf_folder(),
        dtype=setup.engine_dtype,
        tensor_parallel_size=rollout.engine_tensor_parallel_size,
        worker_gpus=engine_worker_gpus(setup.device, rollout.engine_tensor_parallel_size),
        **({"load_format": "dummy"} if setup.starts_without_weights else {}),
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enforce_eager=rollout.engine_eager,
        max_model_len=sized.max_model_len,
        kv_cache_gib=sized.kv_cache_gib,
        enable_sleep_mode=True,
        record_routes=setup.record_routes,
        **setup.quantization_options(),
    )


def engine_worker_gpus(
    device: str, tensor_parallel_size: int, world_size: int | None = None
) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of a colocated engine's workers: on GPUs, from this rank's
    current GPU on (the ranks after it on the node, whose actors share their GPU with a worker);
    None on the CPU or when the one worker runs in this process (tensor parallel 1 in a trainer
    world of one rank, :func:`executor_backend`; ``world_size`` default: this process's)."""
    world = process_world_size() if world_size is None else world_size
    if not device.startswith("cuda") or executor_backend(tensor_parallel_size, world) == "uni":
        return None
    return worker_gpus(
        torch.cuda.current_device(),
        tensor_parallel_size,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        "rollout.engine_tensor_parallel_size",
    )


def connect_server(setup: EngineSetup) -> RolloutEngine:
    """A client of the replica's vLLM server (refused within a bounded time when the URL does
    not answer), sending weights by ``rollout.weight_transport`` (the same-host route writes
    them under the work folder)."""

    api_key = rollout_api_key(setup.rollout)
    check_server_answers(setup.url, server="vLLM server", api_key=api_key)
    return VLLMServerClient.connect(
        setup.url,
        setup.model,
        weights_dir=setup.work_dir / f"vllm_weights_dp{setup.dp_rank}",
        timeout=setup.http_timeout,
        api_key=api_key,
        # shard to shard, the workers join the trainer's transfer group instead: the client's
        # broadcast group stays unbuilt
        weight_transport="process-group"
        if setup.rollout.weight_transport == "shard-to-shard"
        else setup.rollout.weight_transport,
        record_routes=setup.record_routes,
    )
