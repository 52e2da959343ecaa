"""Packed rows: the sequences of a micro-batch concatenated into one row (Megatron's THD
format), so that no forward or backward pass computes right padding.

A packed micro-batch is a one-row :class:`~bapo_megatron.actor.batch.PolicyBatch` whose
``segments`` say where each sequence lies in the row. Each sequence keeps its tokens up to its
last response token (what follows it predicts nothing the loss or the log-probs use) and is
padded to the layout's length multiple (sequence parallelism splits the row over the
tensor-parallel ranks; FP8 GEMMs want multiples of 16 or 128); a padding segment may close the
row where the pipeline needs rows of one length. Padding inside a segment lies after the
sequence's real tokens, so causal attention keeps it from them, and it is never a response
token. The model sees the segment boundaries as ``PackedSeqParams.cu_seqlens``: rotary
embeddings restart at every segment and attention stays inside it.

Every per-token tensor of the packed row is gathered from the unpacked ``[n, s]`` batch through
one index (``source_index``: the flat position ``row * s + column`` each packed token came
from, -1 for padding), and results go back through the same index (:func:`unpack_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.packed_segments import PackedSegments


@dataclass(frozen=True)
class Multiples:
    """What lengths must be multiples of."""

    sequence: int = 1
    """Each packed sequence: sequence parallelism splits every row over the tensor-parallel
    ranks (and a packed sequence must not straddle a rank unevenly)."""
    row: int = 1
    """Each row (its total tokens): ``sequence`` times what FP8 GEMMs need of each rank's token
    count (16, 128 for the blockwise recipe), which applies to the row, not to each sequence."""


def sequence_lengths(batch: PolicyBatch) -> list[int]:
    """Tokens each sequence keeps in a packed row: up to and including its last response token
    (0 for a sequence without any, which is left out of the rows)."""
    mask = batch.response_mask
    if mask.numel() == 0:
        return [0] * batch.num_sequences
    positions = torch.arange(mask.shape[1])
    return (torch.where(mask, positions, -1).amax(dim=1) + 1).tolist()


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def packed_row(
    batch: PolicyBatch,
    rows: list[int],
    lengths: list[int],
    multiples: Multiples,
    row_length: int | None = None,
) -> PolicyBatch:
    """The sequences ``rows`` of ``batch`` (their ``lengths`` from :func:`sequence_lengths`) as
    one packed row, each padded to ``multiples.sequence``; a padding segment extends the row to
    ``multiples.row``, or to ``row_length`` when given. No rows gives a row of padding alone (an
    empty micro-batch)."""
    s = batch.tokens.shape[1]
    spans = [round_up(lengths[row], multiples.sequence) for row in rows]
    used = sum(spans)
    total = max(round_up(max(used, 2), multiples.row), row_length or 0)
    if row_length is not None and row_length < used:
        raise ValueError(f"packed row: {used} tokens do not fit in a row of {row_length}")
    source = torch.full((total,), -1, dtype=torch.long)
    bounds, start = [0], 0
    for row, span in zip(rows, spans, strict=True):
        source[start : start + lengths[row]] = row * s + torch.arange(lengths[row])
        start += span
        bounds.append(start)
    sequences = list(rows)
    if total > used:
        bounds.append(total)
        sequences.append(-1)
    segments = PackedSegments(
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        sequences=tuple(sequences),
        source_index=source,
    )
    adv = batch.advantages
    if adv is not None and adv.dim() == 1:  # one value per sequence: copied to its tokens
        adv = adv[:, None].expand(batch.tokens.shape)
    return PolicyBatch(
        tokens=_gathered(batch.tokens.long(), source, 0),
        response_mask=_gathered(batch.response_mask, source, False),
        old_logprobs=_gathered(batch.old_logprobs, source, 0.0),
        advantages=_gathered(adv, source, 0.0),
        is_weights=_gathered(batch.is_weights, source, 0.0),
        ref_logprobs=_gathered(batch.ref_logprobs, source, 0.0),
        routes=_gathered(batch.routes, source, -1),
        segments=segments,
    )


def _gathered(values: torch.Tensor | None, source: torch.Tensor, fill) -> torch.Tensor | None:
    """``[1, T, ...]``: the per-token ``values [n, s, ...]`` at ``source`` (``fill`` at -1)."""
    if values is None:
        return None
    flat = values.reshape(-1, *values.shape[2:])
    real = source >= 0
    out = flat[source.clamp(min=0)]
    out[~real] = fill
    return out[None]


def unpack_tokens(
    packed: list[torch.Tensor], microbatches: list[PolicyBatch], shape: tuple[int, int]
) -> torch.Tensor:
    """Per-token results of packed rows (``packed[m]``: ``[1, T_m, ...]`` for micro-batch m)
    in the unpacked batch's ``[n, s, ...]`` layout; positions no row computed hold 0 (-1 for
    integer results such as routes: no route)."""
    n, s = shape
    trailing = packed[0].shape[2:]
    integer = not packed[0].dtype.is_floating_point
    out = torch.full((n * s, *trailing), -1 if integer else 0, dtype=packed[0].dtype)
    for values, microbatch in zip(packed, microbatches, strict=True):
        source = microbatch.segments.source_index
        real = source >= 0
        out[source[real]] = values[0, : source.shape[0]][real.to(values.device)].to(out.device)
    return out.reshape(n, s, *trailing)
