"""What a command-line process installs before anything imports Megatron-Core.

Megatron-Core warns at import that Transformer Engine or Apex is missing, imports wandb only to
see that it is there, and imports TorchDynamo for ``torch.compile`` decorators most runs never
call (``bapo_megatron/megatron_patches/``: ``import_warnings``, ``deferred_wandb``,
``deferred_jit_compile``). Each changes process-wide state (a warnings filter,
``sys.modules["wandb"]``, an import hook), so it is the choice of a process's entry point, not
of ``import bapo_megatron``: the console scripts and ``python -m bapo_megatron.train``
(:mod:`bapo_megatron.commands.console`) and the tools in ``tools/`` call :func:`prepare_process`
first, and a program that uses the package as a library keeps its own imports as they are.

It also bounds how long torch's OpenMP threads spin when they wait (``GOMP_SPINCOUNT=10000``,
unless set): GNU OpenMP's default spins for a long while at every barrier, so when another
process holds one of the cores, the spinning thread takes the time slice its partner needs,
once per parallel region. With other jobs on 2 cores, a greedy decode of SmolLM2-135M took
89-100 s at the default, 29-33 s at 10,000 and 12 s with ``OMP_WAIT_POLICY=PASSIVE``; on a quiet
machine PASSIVE made the tiny CPU run 1.5x slower (its small ops wait for threads to wake) and
10,000 1.07x (docs/benchmarks.md). Set ``OMP_WAIT_POLICY=PASSIVE`` on a machine you share.
"""

from __future__ import annotations

import os
import sys

from bapo_megatron.megatron_patches.deferred_jit_compile import defer_jit_compile
from bapo_megatron.megatron_patches.deferred_wandb import defer_wandb_import
from bapo_megatron.megatron_patches.import_warnings import quiet_missing_accelerator_warnings


def prepare_process() -> None:
    """Silence Megatron-Core's missing-accelerator warnings and defer its imports of wandb and
    TorchDynamo, and bound OpenMP's spinning at barriers. Call before anything imports
    megatron; where megatron, wandb or torch is imported already, that part does nothing.
    Idempotent."""
    if "torch" not in sys.modules:  # libgomp reads its settings once, when torch loads it
        if "OMP_WAIT_POLICY" not in os.environ:  # a policy the user chose decides alone
            os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    quiet_missing_accelerator_warnings()
    defer_wandb_import()
    defer_jit_compile()
