"""Helper processes that end with the trainer that started them.

A trainer killed with SIGKILL runs no cleanup, and the pipes of a helper process do not tell it
either (other processes of the trainer, such as the checkpoint writer's forked children, hold
copies of their ends). Without this, every killed run would leave its reward workers and the
checkpoint writer's forked children running for good. This module imports no Megatron, so the
helpers that import it start fast.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


_fork_hook_installed = False
_forking_pid: int | None = None


def _remember_forking_process() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _end_with_forking_process() -> None:
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _forking_pid:  # it died before the prctl call
        os._exit(1)


def forked_writers_end_with_us() -> None:
    """Megatron-Core's torch_dist writer (0.16, ``FileSystemWriterAsync.
    write_preloaded_data_multiproc``) forks one process per write bucket from the saving thread.
    A fork child that outlives a SIGKILLed trainer blocks for good in its results queue's feeder
    thread (nobody reads the pipe any more). Every child forked by this process from now on gets
    ``PR_SET_PDEATHSIG``, so it ends with the trainer. (Only Python-level forks run the hook:
    spawned processes and ``subprocess`` are not affected.) Idempotent."""
    global _fork_hook_installed
    if _fork_hook_installed:
        return
    os.register_at_fork(before=_remember_forking_process, after_in_child=_end_with_forking_process)
    _fork_hook_installed = True
