"""What engines share when they load weights: a checksum of what was loaded, and flattening the
live export's buckets into (name, tensor) pairs."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch


def named_tensors_of(buckets: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of an iterable of export buckets
    (:class:`bapo_megatron.weights.export.WeightBucket`, anything with a ``tensors`` dict)."""
    for bucket in buckets:
        yield from bucket.tensors.items()


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
