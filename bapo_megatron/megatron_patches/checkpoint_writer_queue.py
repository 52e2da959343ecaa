"""Megatron-Core's checkpoint-writer results queue, kept in this process.

Megatron-Core's torch_dist writer (0.16, ``dist_checkpointing/strategies/filesystem_async.py``)
hands each save's write results through a module-global queue that its first save creates as a
``multiprocessing`` Manager queue: a spawn-started server process, there for asynchronous saves,
whose results are put from a forked process. This project saves synchronously only (the writer
runs in the saving process, and only its forked per-bucket children are other processes, with
queues of their own), so the results are put and read in this process. The Manager cost every
saving process a server that outlived a SIGKILLed trainer unless told otherwise, and, at the
first save, the seconds that server spent importing torch to unpickle the results (4-6 s of a
tiny run's 20 s on 2 cores). An in-process queue has neither.
"""

from __future__ import annotations

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async


def checkpoint_writer_queue_in_process() -> None:
    """Before a synchronous ``dist_checkpointing.save``: give Megatron's writer an in-process
    results queue, unless it has one already (an asynchronous save made elsewhere in this
    process created its Manager queue first; that one keeps working). An asynchronous save
    after this would put its results in a forked copy of the queue, and Megatron's finalize
    then reports "results_queue should not be empty" instead of waiting. Idempotent."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
