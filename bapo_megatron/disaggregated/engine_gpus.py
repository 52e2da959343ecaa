"""Which GPUs an engine rank's in-process vLLM/SGLang engine may use. Written for GPU nodes and
never run on one (docs/validation.md): it only sets ``CUDA_VISIBLE_DEVICES``, the variable both
engines document for choosing devices.

torchrun starts every rank of a node with all of the node's GPUs visible, and an in-process
engine takes the first ones it sees, so engine ranks that share a node would all land on its
first GPU. The engine rank with node-local rank ``r`` and ``rollout.engine_tensor_parallel_size``
= t takes the node's GPUs ``r * t .. r * t + t - 1`` (of those already visible, if the launcher
restricted them): on a node of trainer ranks 0..3 and engine ranks 4..7 with t = 1, the engines
take GPUs 4..7; on an engine node with one rank spanning 8 GPUs, rank 0 takes 0..7. The variable
is set before the engine (and CUDA) is first imported in the process.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from bapo_megatron.rollout.vllm.tensor_parallel import worker_gpus

GPU_ENGINES = ("vllm", "sglang")
"""Engine kinds that run on GPUs in the engine rank's process."""


def engine_gpus(local_rank: int, tensor_parallel_size: int, visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value of an engine rank (see the module docstring):
    ``ValueError`` naming the setting when the node has too few visible devices for it."""
    return worker_gpus(
        local_rank * tensor_parallel_size,
        tensor_parallel_size,
        visible,
        f"engine rank with LOCAL_RANK={local_rank} and rollout.engine_tensor_parallel_size",
    )


def pin_engine_gpus(engine: str, tensor_parallel_size: int, env: MutableMapping[str, str]) -> None:
    """Set ``CUDA_VISIBLE_DEVICES`` in ``env`` (the process environment) for a GPU engine kind
    started by torchrun (``LOCAL_RANK`` set); nothing for the embedded CPU engine."""
    if engine not in GPU_ENGINES or "LOCAL_RANK" not in env:
        return
    env["CUDA_VISIBLE_DEVICES"] = engine_gpus(
        int(env["LOCAL_RANK"]), tensor_parallel_size, env.get("CUDA_VISIBLE_DEVICES")
    )


def pin_this_process(engine: str, tensor_parallel_size: int) -> None:
    """:func:`pin_engine_gpus` on this process's environment."""
    pin_engine_gpus(engine, tensor_parallel_size, os.environ)
