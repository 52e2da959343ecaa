"""Gloo's transport threads in the test process, and the collection that ends idle ones.

Gloo's TCP transport runs one thread per live process group, and that thread wakes every 10 ms
(its epoll timeout) whether or not the group is used. A test that builds a layout in the test
process leaves its ~20 groups held by reference cycles (the actor, its optimizer, their hooks)
until the garbage collector's next full pass, which a large test process runs rarely. Measured on
the 2-core machine: the test process held up to 115 such threads, and their wake-ups were 18% of
the whole suite's CPU samples (``perf record -a`` over a full run)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch.distributed as dist

_TASKS = Path("/proc/self/task")


def gloo_transport_threads() -> int:
    """Threads of gloo's TCP transport in this process (0 where ``/proc`` is absent)."""
    count = 0
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            count += (task / "comm").read_text().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended while we looked
            pass
    return count


def gloo_transport_threads_reaching(expected: int, timeout_s: float = 60.0) -> int:
    """The count of :func:`gloo_transport_threads` once it equals ``expected``, else the count at
    the deadline: a new thread names itself, and an ended one leaves ``/proc``, a moment after the
    call that made or joined it returns."""
    deadline = time.monotonic() + timeout_s
    while (count := gloo_transport_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def release_idle_gloo_groups() -> None:
    """Between tests: with no torch.distributed world left, collect the cycles that keep the last
    test's groups, and so their threads, alive."""
    if not dist.is_initialized() and gloo_transport_threads():
        gc.collect()
