"""Shard maps from observed elements: which HF element each local element received, compressed
into the :class:`~bapo_megatron.models.shard_map.ShardMap` format.

An engine's loaders can be watched rather than described: load a tensor whose every element holds
its own flat index + 1 into stand-ins filled with -1, and each stand-in element then reads the HF
element it received (``k`` > 0: element ``k - 1``), a fill (0) or nothing (-1).
:func:`observed_parts` turns one such observation into regions and fills;
:func:`mark_replicated` marks what several ranks of one model replica hold alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bapo_megatron.models.shard_map import Fill, Region, ShardMap, coverage_counts, matrix_shape

UNWRITTEN = -1.0
"""What a stand-in element holds until a loader writes it."""


def observed_parts(
    hf: str, hf_shape: Sequence[int], local: str, values: np.ndarray
) -> tuple[list[Region], list[Fill]]:
    """Regions and fills of the local tensor ``local`` (``values``: its elements, after loading
    ``hf`` as indices + 1 into a stand-in of :data:`UNWRITTEN`; fills are cut into runs per row
    of its last dimension). ``ValueError`` when a
    written value is not an element of ``hf`` or a fill, i.e. the loader changed the values."""
    values = np.asarray(values, dtype=np.float64)
    local_cols = values.shape[-1] if values.ndim else 1
    values = values.reshape(-1)
    hf_numel = int(np.prod(hf_shape))
    written = np.flatnonzero(values != UNWRITTEN)
    got = values[written]
    bad = (got != np.round(got)) | (got < 0) | (got > hf_numel)
    if bad.any():
        where = int(written[np.flatnonzero(bad)[0]])
        raise ValueError(
            f"loading {hf!r} wrote {values[where]!r} to element {where} of {local!r}, which is "
            f"neither an element index + 1 (1..{hf_numel}) nor a fill (0): the loader changes "
            "values"
        )
    source = got.astype(np.int64) - 1
    held = source >= 0
    _, hf_cols = matrix_shape(hf_shape)
    regions = [
        Region(hf, row, col, rows, cols, local, offset, stride)
        for row, col, rows, cols, offset, stride in rectangles(written[held], source[held], hf_cols)
    ]
    filled = written[~held]
    fills = [
        Fill(local, offset, rows, cols, stride)
        for _, _, rows, cols, offset, stride in rectangles(filled, filled, local_cols)
    ]
    return regions, fills


def rectangles(
    local: np.ndarray, source: np.ndarray, source_cols: int
) -> list[tuple[int, int, int, int, int, int]]:
    """``(row, col, rows, cols, offset, row_stride)`` rectangles holding every pair ``local[i]``
    <- ``source[i]`` (flat indices; the source read as a matrix of ``source_cols`` columns):
    runs contiguous on both sides within one source row, and consecutive runs of the same columns
    on consecutive rows at a constant local stride merged, in local order."""
    if local.size == 0:
        return []
    order = np.argsort(local, kind="stable")
    loc, src = local[order], source[order]
    row, col = np.divmod(src, source_cols)
    cut = (np.diff(loc) != 1) | (np.diff(src) != 1) | (np.diff(row) != 0)
    starts = np.concatenate(([0], np.flatnonzero(cut) + 1))
    lengths = np.diff(np.concatenate((starts, [loc.size])))
    r, c, o = row[starts], col[starts], loc[starts]
    # runs that can extend the previous run's rectangle (same columns, next row)
    chained = np.zeros(starts.size, dtype=bool)
    chained[1:] = (c[1:] == c[:-1]) & (lengths[1:] == lengths[:-1]) & (r[1:] == r[:-1] + 1)
    found = []
    first = 0
    for last in [*np.flatnonzero(~chained)[1:], starts.size]:
        found.extend(_chain(r[first:last], c[first], lengths[first], o[first:last]))
        first = last
    return found


def _chain(rows: np.ndarray, col: int, cols: int, offsets: np.ndarray):
    """Rectangles of one chain of runs (consecutive rows, same columns): one where the local
    stride is constant, else cut wherever it changes."""
    steps = np.diff(offsets)
    if steps.size == 0 or (steps == steps[0]).all():
        stride = int(steps[0]) if steps.size else int(cols)
        return [(int(rows[0]), int(col), int(rows.size), int(cols), int(offsets[0]), stride)]
    cut = int(np.flatnonzero(steps != steps[0])[0]) + 1
    stride = int(steps[0]) if cut > 1 else int(cols)
    head = [(int(rows[0]), int(col), cut, int(cols), int(offsets[0]), stride)]
    return head + _chain(rows[cut:], col, cols, offsets[cut:])


def mark_replicated(
    maps: Sequence[ShardMap], hf_shapes: dict[str, Sequence[int]]
) -> list[ShardMap]:
    """``maps`` (the ranks of one model replica) with every region that another of them holds
    too marked ``replicated``."""
    counts = coverage_counts((r for m in maps for r in m.regions), hf_shapes)
    marked = []
    for shard_map in maps:
        regions = []
        for region in shard_map.regions:
            _, hf_cols = matrix_shape(hf_shapes[region.hf])
            shared = bool((counts[region.hf][region.hf_indices(hf_cols)] > 1).any())
            regions.append(region._replace(replicated=shared))
        marked.append(
            ShardMap(shard_map.rank, tuple(regions), shard_map.fills, shard_map.local_shapes)
        )
    return marked
