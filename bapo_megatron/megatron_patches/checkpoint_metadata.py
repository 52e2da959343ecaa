"""A check of the one file Megatron's checkpoint load unpickles in full (megatron-core 0.16.1,
torch 2.x).

``dist_checkpointing.load`` of a torch_dist checkpoint reads ``common.pt`` and the object shards
with ``torch.load`` under torch's default ``weights_only=True`` (an allow-list: no code runs),
but the ``.metadata`` file (torch.distributed.checkpoint's index of the tensors) with torch's
``FileSystemReader.read_metadata``, which is a plain ``pickle.load``: a crafted file runs any code
it names. :func:`check_metadata` reads it first with an unpickler that only constructs the
metadata classes, sizes and dtypes such a file holds, and refuses the folder otherwise.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata

METADATA_FILE = ".metadata"

# What torch_dist metadata files hold: the dataclasses and enums of torch.distributed
# .checkpoint.metadata, torch.Size, dtypes, layouts and memory formats, ordered dicts.
_ALLOWED_MODULES = {dcp_metadata.__name__}
_ALLOWED = {("torch", "Size"): torch.Size, ("collections", "OrderedDict"): collections.OrderedDict,
            ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}
_TORCH_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and "." not in name:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type):
                return found
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANT_TYPES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type")


def check_metadata(folder: str | Path) -> None:
    """``ValueError`` naming ``folder``'s ``.metadata`` file if unpickling it would construct
    anything but torch.distributed.checkpoint metadata (a folder without one is left to
    Megatron's own checks)."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        return
    try:
        with path.open("rb") as file:
            _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} is refused: torch's checkpoint reader would unpickle it in "
                         f"full, and it names something other than checkpoint metadata ({err}), "
                         "which loading would run") from None
    except Exception as err:  # noqa: BLE001 - a damaged file fails in many ways
        raise ValueError(f"{path} cannot be read: {err!r}") from None
