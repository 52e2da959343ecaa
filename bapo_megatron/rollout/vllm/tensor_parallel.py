"""An in-process vLLM spread over several devices (``tensor_parallel_size`` > 1): its executor,
the devices and CPU threads its workers get, what a worker that fails looks like to the caller,
and the agreement of the workers' checksums after a weight update.

At tensor parallel 1 vLLM runs its single worker in the caller's process (executor ``uni``). At
N > 1 it runs vLLM's multiprocess executor (``mp``) from the caller: N worker processes, one per
device, driven through shared-memory queues by the engine core, which stays in the caller's
process. Why ``mp`` and not vLLM's ``external_launcher`` (every trainer rank on the engine's
GPUs hosting one worker inside the torchrun world) is in docs/rollout-engines.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's CPU thread binding. Its default, ``auto``, binds worker ``i`` to the ``i``-th NUMA node
and refuses to start N workers on a host with fewer than N nodes."""


def process_world_size() -> int:
    """Ranks of this process's ``torch.distributed`` world (1 when it has none)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def executor_backend(tensor_parallel_size: int, world_size: int = 1) -> str:
    """vLLM's ``distributed_executor_backend`` for an in-process engine of that size, started in
    a process whose ``torch.distributed`` world has ``world_size`` ranks: ``uni`` (the worker
    in this process) only at size 1 in a world of one. A worker in this process builds vLLM's
    groups over the world it finds, collectives the trainer's other ranks never join."""
    return "uni" if tensor_parallel_size == 1 and world_size == 1 else "mp"


def numa_nodes() -> int:
    """NUMA nodes this process may allocate on (vLLM's own count when it has one)."""
    try:
        from vllm.utils.cpu_resource_utils import get_visible_memory_node
    except ImportError:
        nodes = (
            sorted(os.listdir("/sys/devices/system/node"))
            if os.path.isdir("/sys/devices/system/node")
            else []
        )
        return max(1, sum(1 for name in nodes if name.startswith("node")))
    return max(1, len(get_visible_memory_node()))


def cpu_thread_binding(tensor_parallel_size: int, env: MutableMapping[str, str]) -> str | None:
    """Set ``VLLM_CPU_OMP_THREADS_BIND`` in ``env`` so that ``tensor_parallel_size`` CPU workers
    start on this host: ``nobind`` when the host has fewer NUMA nodes than workers (vLLM's
    ``auto`` would refuse), nothing otherwise. A value the user set is kept. Returns the value
    set, or None."""
    if tensor_parallel_size == 1 or THREADS_BIND in env:
        return None
    if numa_nodes() >= tensor_parallel_size:
        return None
    env[THREADS_BIND] = "nobind"
    return "nobind"


def worker_gpus(first: int, count: int, visible: str | None, field: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` of an engine's workers: ``count`` GPUs of the node from its
    ``first`` (of those ``visible`` already, if the launcher restricted them). ``ValueError``
    naming ``field`` when the node has too few."""
    wanted = range(first, first + count)
    if visible is None or not visible.strip():
        return ",".join(map(str, wanted))
    devices = [device.strip() for device in visible.split(",") if device.strip()]
    if wanted.stop > len(devices):
        raise ValueError(
            f"{field}={count} needs GPUs {first}..{wanted.stop - 1} of its node, but "
            f"CUDA_VISIBLE_DEVICES={visible!r} shows {len(devices)}"
        )
    return ",".join(devices[i] for i in wanted)


@contextmanager
def visible_to_workers(gpus: str | None, env: MutableMapping[str, str]) -> Iterator[None]:
    """Show the workers started inside the block only ``gpus`` (``CUDA_VISIBLE_DEVICES``, read
    when each process starts); the caller's own CUDA context, made earlier, keeps its devices.
    ``None`` changes nothing."""
    if gpus is None:
        yield
        return
    before = env.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        yield
    finally:
        if before is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = before


def executor_of(llm: Any) -> Any | None:
    """The executor of an in-process ``vllm.LLM`` (engine core in this process), or None."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return getattr(getattr(core, "engine_core", None), "model_executor", None)


def dead_workers(llm: Any) -> list[str]:
    """The worker processes of ``llm``'s multiprocess executor that have ended, each as
    ``VllmWorker-<rank> (pid <pid>, exit code <code>)``; [] for other executors."""
    executor = executor_of(llm)
    dead = []
    for handle in getattr(executor, "workers", None) or []:
        process = getattr(handle, "proc", None)
        if process is None or process.exitcode is None:
            continue
        dead.append(f"{process.name} (pid {process.pid}, exit code {process.exitcode})")
    return dead


class WorkerFailure(RuntimeError):
    """A worker process of a multi-process vLLM engine failed to start or ended."""


def failed_workers_error(llm: Any, action: str, error: BaseException) -> WorkerFailure | None:
    """A :class:`WorkerFailure` naming the ended workers when ``error`` (raised by ``action``)
    came from them, else None."""
    dead = dead_workers(llm)
    executor = executor_of(llm)
    if not dead and not getattr(executor, "is_failed", False):
        return None
    who = ", ".join(dead) if dead else "a worker process (its exit was seen by vLLM's monitor)"
    return WorkerFailure(
        f"vLLM engine: {who} ended while {action}; the engine was shut down and must be "
        f"started again ({type(error).__name__}: {error})"
    )


def start_failure(tensor_parallel_size: int, error: BaseException) -> WorkerFailure:
    """The error of an engine whose worker processes did not all start."""
    workers = ", ".join(f"VllmWorker-{rank}" for rank in range(tensor_parallel_size))
    return WorkerFailure(
        f"vLLM engine at tensor_parallel_size={tensor_parallel_size}: a worker process "
        f"({workers}) failed to start; its traceback is in the log, on lines prefixed "
        f"'(VllmWorker-<rank> pid=<pid>)' ({type(error).__name__}: {error})"
    )
