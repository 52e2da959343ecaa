"""The startup check that keeps checkpoint loading free of unpickling.

Every checkpoint file this project reads is loaded without running code from it: its own files
with ``torch.load(weights_only=True)``, Megatron's ``common.pt`` with torch's default, which is
``weights_only=True`` since torch 2.6. The environment variable
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns that default off for every call that does not pass
``weights_only`` (Megatron's), so that a crafted checkpoint could run code when loaded. A process
that loads checkpoints refuses to start with it set, rather than trust every call site.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

UNSAFE_LOAD_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
# what torch.load counts as set (torch/serialization.py reads the variable the same way)
_TORCH_TRUE_VALUES = ("1", "y", "yes", "true")


def refuse_unpickling_loads(environ: Mapping[str, str] | None = None) -> None:
    """``ValueError`` (one line) when ``environ`` (default: this process's environment) sets
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` to a value torch honours."""
    environ = os.environ if environ is None else environ
    value = environ.get(UNSAFE_LOAD_VARIABLE)
    if value is not None and value.lower() in _TORCH_TRUE_VALUES:
        raise ValueError(
            f"{UNSAFE_LOAD_VARIABLE}={value} is set in the environment: it makes torch.load "
            "unpickle checkpoint files, which can run code from them; unset it (checkpoints "
            "of this project never need it)"
        )
