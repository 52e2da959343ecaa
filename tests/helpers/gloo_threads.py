"""Gloo's transport threads in this process: one per live gloo process group, each waking every
10 ms (its epoll timeout) whether or not the group is used, until the group is freed."""

from __future__ import annotations

import time
from pathlib import Path

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
