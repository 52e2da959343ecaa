"""Run a per-micro-batch function on the last stage's logits through Megatron's pipeline
schedule (no pipelining, 1F1B, or interleaved, as ``get_forward_backward_func`` picks).

The function gets a micro-batch and its vocabulary-parallel logits (a
:class:`~bapo_megatron.actor.response_logits.StageLogits`: only at the positions that predict a
response token, unless ``every_position``) and returns ``(loss, outputs)``: the loss to
backpropagate (ignored in forward-only runs) and a dict of tensors kept for the caller. Only
last-stage ranks call it; they get the dicts back in micro-batch order, every other rank gets an
empty list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.response_logits import (
    StageLogits,
    can_select_rows,
    output_rows,
    predicting_rows,
)
from bapo_megatron.distributed.context import ParallelContext

MicrobatchFn = Callable[[PolicyBatch, StageLogits], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_schedule(
    chunks: list[torch.nn.Module],
    microbatches: list[PolicyBatch],
    fn: MicrobatchFn,
    context: ParallelContext,
    *,
    forward_only: bool,
    before_forward: Callable[[PolicyBatch, torch.nn.Module], None] | None = None,
    every_position: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Forward (and, unless ``forward_only``, backward) every micro-batch through the pipeline.

    All micro-batches must share one shape (see
    :func:`~bapo_megatron.actor.microbatches.build_microbatches`); a packed one (``segments``
    set) reaches the model with its ``PackedSeqParams``.
    Gradients accumulate in the chunks' gradient buffers; reducing them over data-parallel
    ranks is the schedule's ``finalize_model_grads_func`` hook, run after the last backward.
    ``before_forward(microbatch, chunk)`` is called on every stage right before ``chunk`` runs
    the micro-batch (per-token data that modules inside the model need: which tokens a router's
    auxiliary loss counts, the routes its routers replay).
    """
    if not microbatches:
        raise ValueError("run_schedule needs at least one micro-batch")
    batch_size, seq_length = microbatches[0].tokens.shape
    position_ids = torch.arange(seq_length, device=context.device).expand(batch_size, seq_length)

    def loss_func(microbatch: PolicyBatch, rows: torch.Tensor | None, logits: torch.Tensor):
        loss, outputs = fn(microbatch, StageLogits(logits, rows))
        # Megatron adds the middle value to a token count it passes to finalize_model_grads;
        # the loss is normalized already, so the count is unused (zero).
        return loss, torch.zeros((), dtype=torch.int), outputs

    def forward_step(data_iterator, model):
        microbatch = next(data_iterator)
        tokens = microbatch.tokens.to(context.device)
        if before_forward is not None:
            before_forward(microbatch, model)
        rows = None
        if not every_position and can_select_rows(model):
            rows = predicting_rows(microbatch.response_mask).to(context.device)
            rows = rows if rows.numel() else None  # a filler micro-batch: nothing to cut
        segments = microbatch.segments
        with output_rows(model, rows):
            if segments is None:
                output = model(tokens, position_ids, None)
            else:  # a packed row: positions restart at each sequence, attention stays inside
                output = model(
                    tokens,
                    segments.position_ids().to(context.device),
                    None,
                    packed_seq_params=segments.packed_seq_params(context.device),
                )
        return output, functools.partial(loss_func, microbatch, rows)

    # The interleaved schedule takes one iterator per model chunk, each over all micro-batches.
    iterators = [iter(microbatches) for _ in chunks]
    forward_backward = get_forward_backward_func(pp_size=context.pp_size, vp_size=context.vpp_size)
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=batch_size,
        forward_only=forward_only,
        # The pipelined schedules take the groups only together with a communicator.
        p2p_communicator=P2PCommunicator(pp_group=context.pp_group, config=chunks[0].config),
        pg_collection=context.process_groups,
    )


def last_stage_rank(context: ParallelContext) -> int:
    """Global rank of the last pipeline stage in this rank's pipeline group."""
    return torch.distributed.get_global_rank(context.pp_group, context.pp_size - 1)
