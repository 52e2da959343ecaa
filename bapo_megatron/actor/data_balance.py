"""Balance a training step's sequences over the data-parallel ranks by their compute.

Each data-parallel rank rolls out (or receives) its own sequences, and long-tailed response
lengths leave some ranks with several times the work of others; every rank then waits for the
slowest at the gradient all-reduce. Before splitting a step into token-budget micro-batches, the
ranks exchange sequences so that their costs (:func:`~bapo_megatron.actor.token_budget.
sequence_cost`: tokens, and attention's quadratic term) are close. The step's gradient does not
change: the loss is normalized by global counts, so which rank holds a sequence only changes
the order of floating-point sums.

One all-gather of the lengths fixes the assignment (the same on every rank), a second moves the
sequences that change rank; the ranks of one model replica (tensor and pipeline parallel) hold
the same sequences, so each exchanges with its peers of the data-parallel group alone.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.packing import sequence_lengths
from bapo_megatron.actor.token_budget import balance_over_ranks, sequence_cost
from bapo_megatron.distributed.context import ParallelContext

_FIELDS = (
    "tokens",
    "response_mask",
    "old_logprobs",
    "advantages",
    "is_weights",
    "ref_logprobs",
    "routes",
)


def balance_data_parallel(
    batch: PolicyBatch, context: ParallelContext, hidden_size: int
) -> PolicyBatch:
    """This rank's sequences after balancing over ``context.dp_group`` (collective over it).
    Sequences keep their fields; rows are right-padded to the longest received sequence."""
    if context.dp_size == 1:
        return batch
    costs = [sequence_cost(length, hidden_size) for length in sequence_lengths(batch)]
    every = [None] * context.dp_size
    dist.all_gather_object(every, costs, group=context.dp_group)
    plan = balance_over_ranks(every)
    mine = context.dp_rank
    moving = {
        index
        for rank, pairs in enumerate(plan)
        if rank != mine
        for source, index in pairs
        if source == mine
    }
    outgoing = _rows(batch, sorted(moving))
    received = [None] * context.dp_size
    dist.all_gather_object(received, outgoing, group=context.dp_group)
    pieces = []
    for source, index in plan[mine]:
        if source == mine:
            pieces.append(_row(batch, index))
        else:
            shipped = received[source]
            pieces.append(shipped["rows"][shipped["index"].index(index)])
    return _stacked(pieces, batch)


def _row(batch: PolicyBatch, index: int) -> dict[str, torch.Tensor | None]:
    """Sequence ``index`` as its fields, trimmed of right padding (CPU tensors)."""
    length = max(sequence_lengths(batch.select(slice(index, index + 1)))[0], 2)
    row = {}
    for name in _FIELDS:
        value = getattr(batch, name)
        if value is None:
            row[name] = None
        elif name == "advantages" and value.dim() == 1:
            row[name] = value[index].cpu()
        else:
            row[name] = value[index, :length].cpu()
    return row


def _rows(batch: PolicyBatch, indices: list[int]) -> dict:
    return {"index": indices, "rows": [_row(batch, index) for index in indices]}


def _stacked(rows: list[dict], like: PolicyBatch) -> PolicyBatch:
    """``rows`` as one right-padded batch (``like`` gives the dtypes of an empty one)."""
    if not rows:
        return like.select(slice(0, 0))
    length = max(row["tokens"].shape[0] for row in rows)
    fields = {}
    for name in _FIELDS:
        values = [row[name] for row in rows]
        if any(value is None for value in values):
            fields[name] = None
            continue
        if values[0].dim() == 0:  # per-sequence advantages
            fields[name] = torch.stack(values)
            continue
        fill = -1 if name == "routes" else 0
        out = values[0].new_full((len(values), length, *values[0].shape[1:]), fill)
        for i, value in enumerate(values):
            out[i, : value.shape[0]] = value
        fields[name] = out
    return dataclasses.replace(like.select(slice(0, 0)), **fields)
