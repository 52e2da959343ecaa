"""The process's torch threads kept across an in-process vLLM start (vllm 0.32, CPU builds).

vLLM's multiprocess executor (an engine of tensor parallel 2 or more, and a size-1 engine
beside a ``torch.distributed`` world of several ranks) calls ``set_torch_threads_for_runtime``
in the process that starts it once its workers are ready: torch drops to one intra-op thread
for the rest of the process unless ``OMP_NUM_THREADS`` is set (vLLM's reason: that process only
schedules, and spinning OpenMP workers steal cycles from it). A colocated trainer sharing the
process then trained on one thread. (The uniproc executor of a one-process size-1 engine lowers
them too, and puts them back itself.) Inside :func:`torch_threads_kept` the count the process
had before is put back once vLLM is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Within the block vLLM may change ``torch.get_num_threads()``; on exit it is what it was
    on entry (also when the block raises)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
