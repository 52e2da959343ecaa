"""The checksum an engine returns from ``update_weights(..., checksum=True)``: SHA-256 over the
names, dtypes, shapes and bytes of the tensors it loaded, in load order. Every engine computes it
the same way, so the checksums of two engines (or of an engine and the tensors sent to it) can be
compared."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

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


def agreed_checksum(reports: list[Any], expected: str | None, engine: str) -> str | None:
    """The checksum every worker of an engine reported after a weight update (``reports``: one
    ``{"checksum": ...}`` per worker, in rank order). ``RuntimeError`` naming the workers when
    they disagree with each other or with ``expected``, the checksum of what was sent."""
    sums = [report.get("checksum") if isinstance(report, dict) else None for report in reports]
    if not sums or any(value is None for value in sums):
        raise RuntimeError(
            f"{engine}: workers reported no checksum of their update ({reports!r:.300})"
        )
    differing = [rank for rank, value in enumerate(sums) if value != (expected or sums[0])]
    if differing:
        raise RuntimeError(
            f"{engine}: workers {differing} of {len(sums)} loaded other bytes than "
            f"{'were sent' if expected else 'worker 0'} (checksums {sums}, sent {expected})"
        )
    return sums[0]
