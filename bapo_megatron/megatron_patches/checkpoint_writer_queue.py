"""Megatron-Core's checkpoint-writer queue server, started so that it ends with the trainer.

Kept apart from :mod:`bapo_megatron.megatron_patches.child_processes`, which must stay light: the
reward pool's workers and this queue's server import that module (for
:func:`~bapo_megatron.megatron_patches.child_processes.exit_with_parent`) and should not pay for
Megatron's import.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.managers import SyncManager

from megatron.core.dist_checkpointing.strategies import filesystem_async

from bapo_megatron.megatron_patches.child_processes import exit_with_parent

_servers: list[SyncManager] = []


def checkpoint_writer_queue_ends_with_us() -> None:
    """Megatron-Core's torch_dist writer (0.16, ``dist_checkpointing/strategies/
    filesystem_async.py``) keeps a module-global results queue served by a spawn-started
    ``multiprocessing`` Manager, created at the first save. Create it first, with a server that
    ends with this process (see patches/README.md). Idempotent."""
    if filesystem_async._results_queue is not None:
        return
    server = SyncManager(ctx=multiprocessing.get_context("spawn"))
    server.start(initializer=exit_with_parent)
    _servers.append(server)
    filesystem_async._results_queue = server.Queue()
