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

import pickle
from pathlib import Path
from typing import Any

import torch

METADATA_FILE = ".metadata"

# What torch_dist metadata files hold (the classes a save records, listed by name: other classes
# of these modules, such as the file-system writer, do things when constructed), plus torch.Size,
# dtypes and the layout lookup torch pickles tensor properties with.
_ALLOWED_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.planner": (
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
}
_ALLOWED = {(module, name) for module, names in _ALLOWED_CLASSES.items() for name in names}
_ALLOWED |= {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}


class _RefusedType(pickle.UnpicklingError):
    """The file names a class the metadata never holds (a damaged file fails otherwise)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedType(f"{module}.{name} is not a checkpoint metadata type")


def check_metadata(folder: str | Path) -> Any:
    """``folder``'s ``.metadata`` (torch.distributed.checkpoint's ``Metadata``), read safely, or
    None if there is none (left to Megatron's own checks); ``ValueError`` naming the file if
    unpickling it would construct anything but checkpoint metadata, or if it cannot be read."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        return None
    try:
        with path.open("rb") as file:
            return _MetadataUnpickler(file).load()
    except _RefusedType as err:
        raise ValueError(
            f"{path} is refused: torch's checkpoint reader would unpickle it in "
            f"full, and it names something other than checkpoint metadata ({err}), "
            "which loading would run"
        ) from None
    except Exception as err:  # noqa: BLE001 - a damaged file fails in many ways
        raise ValueError(f"{path} cannot be read: {err!r}") from None
