"""The checksum an engine returns from ``update_weights(..., checksum=True)``: SHA-256 over the
names, dtypes, shapes and bytes of the tensors it loaded, in load order. Every engine computes it
the same way, so the checksums of two engines (or of an engine and the tensors sent to it) can be
compared."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


class Checksum:
    """SHA-256 over tensor names, dtypes, shapes and bytes, in the order they are added."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous().cpu()
        self._hash.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        self._hash.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The :class:`Checksum` of ``named_tensors``."""
    total = Checksum()
    for name, tensor in named_tensors:
        total.add(name, tensor)
    return total.hexdigest()
