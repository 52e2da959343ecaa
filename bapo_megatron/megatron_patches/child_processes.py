"""Helper processes that end with the trainer that started them.

A trainer killed with SIGKILL runs no cleanup, and the pipes of a helper process do not tell it
either (other processes of the trainer, such as the checkpoint writer's forked children, hold
copies of their ends). Without this, every killed run would leave its reward workers and
Megatron's checkpoint-writer queue server running for good, each holding a Python with torch.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_servers: list[SyncManager] = []


def exit_with_parent() -> None:
    """Initializer of a spawned helper process: end it when its parent dies. On Linux the
    kernel sends SIGKILL when the parent's starting thread ends (helpers are started from the
    trainer's main thread); elsewhere a thread watches the parent's sentinel."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent.pid:  # it died before the prctl call
            os._exit(1)
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def checkpoint_writer_queue_ends_with_us() -> None:
    """Megatron-Core's torch_dist writer (0.16, ``dist_checkpointing/strategies/
    filesystem_async.py``) keeps a module-global results queue served by a spawn-started
    ``multiprocessing`` Manager, created at the first save. Create it first, with a server that
    ends with this process (see patches/README.md). Idempotent."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    server = SyncManager(ctx=multiprocessing.get_context("spawn"))
    server.start(initializer=exit_with_parent)
    _servers.append(server)
    filesystem_async._results_queue = server.Queue()
