"""Shard maps: which elements of which Hugging Face tensor a rank holds, and where they sit.

One format serves both sides of a weight transfer: a trainer rank's Megatron shards
(:mod:`.trainer_shards`) and an engine worker's tensor-parallel parameters (:mod:`.vllm_shards`).

Every HF tensor is read as a matrix in its own row-major order: ``[rows, cols]`` of a 2-D
tensor, ``[n, 1]`` of a 1-D one. A :class:`Region` is a rectangle of that matrix held in one local
tensor of the rank: ``rows`` runs of ``cols`` contiguous elements, the first run at flat element
``offset`` of the local tensor and each next one ``row_stride`` elements further (on the HF side
the runs start at ``row * C + col`` and are ``C`` apart, ``C`` the matrix's columns). A
:class:`Fill` marks local elements that hold no HF element (the padding rows of a vocabulary
split over ranks): whoever writes the local tensor zeroes them. ``replicated`` marks regions that
other ranks of the same model replica hold too (norms; key/value heads an engine repeats).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, cols)`` of an HF tensor of ``shape`` read as a matrix (1-D: one column)."""
    if len(shape) == 1:
        return shape[0], 1
    if len(shape) == 2:
        return shape[0], shape[1]
    raise ValueError(f"shard maps describe 1-D and 2-D tensors, got shape {tuple(shape)}")


class Region(NamedTuple):
    """A rectangle of one HF tensor, held in one local tensor (a named tuple: plans of large
    models make hundreds of thousands)."""

    hf: str
    """HF tensor name."""
    row: int
    """First row of the rectangle in the HF matrix."""
    col: int
    """First column of the rectangle in the HF matrix."""
    rows: int
    """Rows of the rectangle (runs)."""
    cols: int
    """Columns of the rectangle (elements per run)."""
    local: str
    """Name of the local tensor that holds it."""
    offset: int
    """Flat element of the local tensor where the first run starts."""
    row_stride: int
    """Elements between the starts of consecutive runs in the local tensor."""
    replicated: bool = False
    """Whether other ranks of the same model replica hold this rectangle too."""

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def box(self) -> tuple[str, int, int, int, int]:
        """The HF rectangle alone, ``(hf, row, col, rows, cols)``: equal for every holder."""
        return self.hf, self.row, self.col, self.rows, self.cols

    def within(self, row: int, col: int, rows: int, cols: int) -> Region | None:
        """The part of this region inside the HF rectangle given, with its local offset; None
        when they do not meet."""
        top, left = max(self.row, row), max(self.col, col)
        bottom = min(self.row + self.rows, row + rows)
        right = min(self.col + self.cols, col + cols)
        if top >= bottom or left >= right:
            return None
        if (top, left, bottom - top, right - left) == (self.row, self.col, self.rows, self.cols):
            return self
        offset = self.offset + (top - self.row) * self.row_stride + (left - self.col)
        return Region(
            self.hf,
            top,
            left,
            bottom - top,
            right - left,
            self.local,
            offset,
            self.row_stride,
            self.replicated,
        )

    def local_indices(self) -> np.ndarray:
        """Flat indices of the rectangle's elements in the local tensor, row by row."""
        return run_indices(self.offset, self.rows, self.cols, self.row_stride)

    def hf_indices(self, hf_cols: int) -> np.ndarray:
        """Flat indices of the rectangle's elements in the HF tensor (of ``hf_cols`` columns)."""
        return run_indices(self.row * hf_cols + self.col, self.rows, self.cols, hf_cols)


class Fill(NamedTuple):
    """Local elements that hold no HF element: ``rows`` runs of ``cols`` from ``offset``."""

    local: str
    offset: int
    rows: int
    cols: int
    row_stride: int

    def local_indices(self) -> np.ndarray:
        return run_indices(self.offset, self.rows, self.cols, self.row_stride)


@dataclass(frozen=True)
class ShardMap:
    """What one rank holds: its regions, zero-filled elements and local tensor shapes."""

    rank: int
    """The rank in the group that moves the weights."""
    regions: tuple[Region, ...]
    fills: tuple[Fill, ...] = ()
    local_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(local tensor name, shape)`` of every local tensor the regions and fills name."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.local_shapes)


def run_indices(offset: int, rows: int, cols: int, stride: int) -> np.ndarray:
    """Flat indices of ``rows`` runs of ``cols`` elements, ``stride`` apart, from ``offset``."""
    starts = offset + stride * np.arange(rows, dtype=np.int64)
    return (starts[:, None] + np.arange(cols, dtype=np.int64)[None, :]).reshape(-1)


def coverage_counts(
    regions: Iterable[Region], hf_shapes: Mapping[str, Sequence[int]]
) -> dict[str, np.ndarray]:
    """How many of ``regions`` hold each element of each HF tensor (flat, row-major)."""
    counts = {
        name: np.zeros(int(np.prod(shape)), dtype=np.int64) for name, shape in hf_shapes.items()
    }
    for region in regions:
        if region.hf not in counts:
            raise ValueError(f"shard map: {region.hf!r} is not a tensor of the model")
        _, hf_cols = matrix_shape(hf_shapes[region.hf])
        np.add.at(counts[region.hf], region.hf_indices(hf_cols), 1)
    return counts


def check_local_layout(shard_map: ShardMap) -> None:
    """``ValueError`` unless the regions and fills of ``shard_map`` stay inside their local
    tensors and every local element is written exactly once (by a region or a fill)."""
    shapes = shard_map.shapes()
    written = {
        name: np.zeros(int(np.prod(shape)), dtype=np.int64) for name, shape in shapes.items()
    }
    for part in (*shard_map.regions, *shard_map.fills):
        if part.local not in written:
            raise ValueError(f"rank {shard_map.rank}: no local tensor {part.local!r}")
        indices = part.local_indices()
        if indices.size and (indices.min() < 0 or indices.max() >= written[part.local].size):
            raise ValueError(f"rank {shard_map.rank}: {part} runs outside {part.local!r}")
        np.add.at(written[part.local], indices, 1)
    for name, counts in written.items():
        if (counts != 1).any():
            bad = int(np.flatnonzero(counts != 1)[0])
            raise ValueError(
                f"rank {shard_map.rank}: element {bad} of {name!r} is written "
                f"{int(counts[bad])} times (expected once)"
            )


def _zeros(shape: Sequence[int]) -> np.ndarray:
    return np.zeros(int(np.prod(shape)), dtype=np.int64)
