"""The end of a command-line process: let its shutdown skip the collector's walk.

When a trainer's work is done, its interpreter still spends seconds of CPU shutting down, most
of it the full garbage collection over everything torch, Megatron and transformers keep alive
(some 460,000 objects; docs/benchmarks.md has the figures). Every trainer, rank and worker
process of a run pays it, after its results are written.

:func:`skip_final_collection` moves every live object into the collector's permanent generation
(``gc.freeze``), which that last collection does not walk. ``atexit`` handlers still run and
objects are still released by reference counting as modules are torn down; only garbage cycles
alive at that moment are no longer finalized, which Python does not promise at exit anyway.
For a process's entry point, after its work: a process that goes on (a test session that called
``main()``) would keep whatever it froze.
"""

from __future__ import annotations

import gc


def skip_final_collection() -> None:
    """Call last in a command-line process's ``__main__`` (see the module docstring)."""
    gc.freeze()
