"""How one data-parallel rank's sequences become the micro-batches of a pass: rows right-padded
to the longest sequence, ``micro_batch_size`` at a time (:func:`~bapo_megatron.actor.batch.
split_microbatches`), or packed rows (:mod:`bapo_megatron.actor.packing`) filled by count or by
a token budget (first-fit decreasing, :mod:`bapo_megatron.actor.token_budget`).

Training steps and forward-only passes call the same two functions: :func:`plan_groups` (which
sequences go together, and so how many micro-batches this rank needs: every data-parallel rank
must then run the same count) and :func:`build_microbatches` (the micro-batches themselves,
empty ones appended up to the agreed count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from bapo_megatron.actor.batch import PolicyBatch, microbatch_count, split_microbatches
from bapo_megatron.actor.packing import Multiples, packed_row, round_up, sequence_lengths
from bapo_megatron.actor.token_budget import over_budget, split_by_token_budget
from bapo_megatron.config import ActorConfig
from bapo_megatron.distributed.context import ParallelContext


@dataclass(frozen=True)
class Batching:
    """How one kind of pass splits its sequences (from the ``actor`` section)."""

    micro_batch_size: int = 1
    """Sequences per micro-batch, padded or packed, where no token budget is set."""
    pack: bool = False
    """One packed row per micro-batch (``actor.pack_sequences``)."""
    max_tokens: int | None = None
    """Token budget of a packed micro-batch; None: ``micro_batch_size`` sequences each."""

    @classmethod
    def for_training(cls, actor: ActorConfig) -> Batching:
        return cls(actor.micro_batch_size, actor.pack_sequences, actor.max_tokens_per_microbatch)

    @classmethod
    def for_logprobs(cls, actor: ActorConfig) -> Batching:
        return cls(actor.micro_batch_size, actor.pack_sequences, actor.logprob_token_budget())


def length_multiples(context: ParallelContext, fp8_multiple: int = 1) -> Multiples:
    """The :class:`Multiples` of ``context``'s layout (``fp8_multiple``:
    :func:`~bapo_megatron.config.parallel.fp8_length_multiple`, 1 without FP8)."""
    sequence = context.tp_size if context.config.sequence_parallel else 1
    return Multiples(sequence=sequence, row=sequence * fp8_multiple)


@dataclass(frozen=True)
class Groups:
    """Which sequences share a micro-batch, before any are built."""

    count: int
    """Micro-batches this rank needs."""
    rows: list[list[int]] | None = None
    """Packed: the batch rows of each micro-batch (None: padded, in order)."""
    lengths: list[int] | None = None
    """Packed: the tokens each sequence keeps (:func:`~bapo_megatron.actor.packing.
    sequence_lengths`)."""
    over_budget: int = 0
    """Sequences longer than the token budget (each alone in its micro-batch)."""
    row_length: int = 0
    """The longest row this rank builds (padded: the batch's length, rounded up)."""


def plan_groups(batch: PolicyBatch, batching: Batching, multiples: Multiples) -> Groups:
    """The micro-batches ``batch`` needs under ``batching`` (sequences without a response token
    are left out of packed rows: they predict nothing)."""
    if not batching.pack:
        return Groups(
            count=microbatch_count(batch.num_sequences, batching.micro_batch_size),
            row_length=round_up(max(batch.tokens.shape[1], 2), multiples.row),
        )
    lengths = sequence_lengths(batch)
    kept = [row for row, length in enumerate(lengths) if length > 0]
    # a rank whose sequences have no response token still runs one (empty) micro-batch
    least = 1 if batch.num_sequences else 0
    if batching.max_tokens is None:
        size = batching.micro_batch_size
        rows = [kept[i : i + size] for i in range(0, len(kept), size)]
        return Groups(
            count=max(len(rows), least),
            rows=rows,
            lengths=lengths,
            row_length=_longest_row(rows, lengths, multiples),
        )
    packed = [round_up(lengths[row], multiples.sequence) for row in kept]
    split = split_by_token_budget(packed, batching.max_tokens)
    rows = [[kept[i] for i in group] for group in split]
    return Groups(
        count=max(len(rows), least),
        rows=rows,
        lengths=lengths,
        over_budget=over_budget(packed, batching.max_tokens),
        row_length=_longest_row(rows, lengths, multiples),
    )


def _longest_row(rows: list[list[int]], lengths: list[int], multiples: Multiples) -> int:
    used = [sum(round_up(lengths[r], multiples.sequence) for r in group) for group in rows]
    return round_up(max([*used, 2]), multiples.row)


def rows_agree_over_data_parallel(context: ParallelContext) -> bool:
    """Whether every data-parallel rank's rows must have one length: Megatron's `allgather`
    token dispatcher gathers the tokens of the expert-parallel ranks (drawn from data-parallel
    ranks) into one tensor and needs the same count from each."""
    parallel = context.config
    return parallel.expert_model_parallel_size > 1 and parallel.moe_token_dispatcher == "allgather"


def agreed_row_length(groups: Groups, context: ParallelContext, agreed: int | None) -> int | None:
    """The length every row of this pass gets (None: each keeps its own): the longest over the
    data-parallel ranks (``agreed``, gathered by the caller) where they must agree, this rank's
    longest where a pipeline needs one shape, else none."""
    if rows_agree_over_data_parallel(context):
        return agreed
    return groups.row_length if context.pp_size > 1 else None


def agree_forward_pass(groups: Groups, context: ParallelContext) -> tuple[int, int]:
    """(micro-batch count, longest row) of a forward-only pass, the largest over the data x
    context parallel group where expert parallelism runs collectives between those ranks inside
    every forward (one all-reduce); this rank's own otherwise."""
    local = (groups.count, groups.row_length)
    if context.config.expert_model_parallel_size == 1 or context.dp_cp_size == 1:
        return local
    agreed = torch.tensor(local, dtype=torch.long, device=context.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=context.dp_cp_group)
    return int(agreed[0]), int(agreed[1])


def build_microbatches(
    batch: PolicyBatch,
    groups: Groups,
    batching: Batching,
    multiples: Multiples,
    count: int,
    row_length: int | None = None,
) -> list[PolicyBatch]:
    """``count`` micro-batches (at least ``groups.count``; the others empty), every row
    ``row_length`` long when given (:func:`agreed_row_length`; padded rows always share one
    length, the batch's unless given)."""
    if groups.rows is None:
        return split_microbatches(
            batch, batching.micro_batch_size, count, multiples.row, row_length
        )
    if count < groups.count:
        raise ValueError(f"{groups.count} packed micro-batches do not fit in {count}")
    rows = groups.rows + [[] for _ in range(count - len(groups.rows))]
    return [packed_row(batch, group, groups.lengths, multiples, row_length) for group in rows]


def padding_share(microbatches: list[PolicyBatch]) -> tuple[int, int]:
    """(positions computed, of which padding) over ``microbatches``: the cost of padding."""
    computed = sum(mb.tokens.numel() for mb in microbatches)
    real = 0
    for mb in microbatches:
        if mb.segments is not None:
            real += int(mb.segments.real_tokens().sum())
        else:
            real += sum(sequence_lengths(mb))
    return computed, computed - real
