"""Per-token log-probs and entropy of a batch under the actor, from vocabulary-parallel logits.

Token-aligned: column t holds log pi(token_t | tokens_<t) and the entropy of that distribution,
both of softmax(logits / temperature) (the distribution the rollout engine sampled from).
Column 0 has no predecessor and holds 0. The forward-only passes return 0 off the response too:
the last stage computes logits only at the positions that predict a response token
(:mod:`bapo_megatron.actor.response_logits`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.microbatches import (
    Batching,
    agree_forward_pass,
    agreed_row_length,
    build_microbatches,
    length_multiples,
    plan_groups,
)
from bapo_megatron.actor.packing import unpack_tokens
from bapo_megatron.actor.pipeline_schedule import last_stage_rank, run_schedule
from bapo_megatron.actor.response_logits import StageLogits, scatter_rows
from bapo_megatron.actor.routing_replay import RoutingReplay
from bapo_megatron.algo.vocab_parallel import token_logprobs_and_entropy
from bapo_megatron.distributed.context import ParallelContext


def token_logprobs(
    logits: StageLogits,
    tokens: torch.Tensor,
    context: ParallelContext,
    *,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-aligned ``[b, s]`` log-probs (and entropy) from this rank's logits (position t
    predicts token t + 1; at every position, or at ``logits.rows`` with 0 elsewhere).
    Differentiable; collectives over the TP group only."""
    values, rows = logits.values, logits.rows
    if rows is None:
        targets, predictors = tokens[:, 1:], values[:, :-1]
    else:  # the tokens the kept rows predict, in the same sequence-first order
        targets, predictors = tokens.t().reshape(-1)[rows + tokens.shape[0]][None], values
    logprobs, entropy = token_logprobs_and_entropy(
        predictors,
        targets.to(values.device),
        vocab_start=context.tp_rank * values.shape[-1],
        group=context.tp_group,
        temperature=temperature,
        with_entropy=with_entropy,
    )
    if rows is None:
        return _shift_right(logprobs), (_shift_right(entropy) if with_entropy else None)
    shape = tuple(tokens.shape)
    return (
        scatter_rows(logprobs[0], rows.to(values.device), shape),
        scatter_rows(entropy[0], rows.to(values.device), shape) if with_entropy else None,
    )


def _shift_right(values: torch.Tensor) -> torch.Tensor:
    return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)


@torch.no_grad()
def compute_logprobs(
    chunks: list[torch.nn.Module],
    batch: PolicyBatch,
    context: ParallelContext,
    *,
    batching: Batching,
    temperature: float,
    with_entropy: bool = True,
    routing: RoutingReplay | None = None,
    fp8_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only pass over this data-parallel rank's ``batch``: ``(logprobs, entropy)``, each
    ``[n, s]`` float32 on the CPU, on every rank of the pipeline (the last stage computes them
    and broadcasts). Used to recompute old log-probs and to check rollout engines. With
    ``routing`` (a mixture-of-experts actor's) and ``batch.routes``, the routers replay them.
    ``batching``: padded or packed micro-batches (:class:`~bapo_megatron.actor.microbatches.
    Batching.for_logprobs`); every column that is not a response token holds 0.
    ``fp8_multiple``: the length multiple FP8 layers need (1 without FP8)."""
    if routing is not None and batch.routes is not None:
        with routing.replaying():
            logprobs, entropy, _ = _forward_pass(
                chunks, batch, context, batching, temperature, with_entropy, routing, fp8_multiple
            )
    else:
        logprobs, entropy, _ = _forward_pass(
            chunks, batch, context, batching, temperature, with_entropy, None, fp8_multiple
        )
    return logprobs, entropy


@torch.no_grad()
def compute_logprobs_and_routes(
    chunks: list[torch.nn.Module],
    batch: PolicyBatch,
    context: ParallelContext,
    routing: RoutingReplay,
    *,
    batching: Batching,
    temperature: float,
    fp8_multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_logprobs` that also records where the routers sent every token:
    ``(logprobs [n, s], routes [n, s, moe_layers, topk])``, both on every rank of the model
    replica (the routes of the actor's own pass, which routing replay `trainer` feeds back to
    the training passes of the step). Packed, tokens after a sequence's last response token
    have no route (-1)."""
    n, s = batch.tokens.shape
    with routing.recording():
        logprobs, _, microbatches = _forward_pass(
            chunks, batch, context, batching, temperature, False, routing, fp8_multiple
        )
        if not microbatches:
            routes = torch.full((0, s, routing.num_layers, routing.topk), -1)
        elif microbatches[0].segments is not None:
            rows = routing.recorded_routes(microbatches, len(microbatches))
            routes = unpack_tokens(list(rows[:, None]), microbatches, (n, s))
        else:
            routes = routing.recorded_routes(microbatches, n)
    return logprobs, routes[:, :s]


def _forward_pass(
    chunks: list[torch.nn.Module],
    batch: PolicyBatch,
    context: ParallelContext,
    batching: Batching,
    temperature: float,
    with_entropy: bool,
    routing: RoutingReplay | None,
    fp8_multiple: int,
) -> tuple[torch.Tensor, torch.Tensor | None, list[PolicyBatch]]:
    n, s = batch.tokens.shape
    if n == 0 and context.config.expert_model_parallel_size == 1:
        empty = torch.zeros(0, s)
        return empty, (empty.clone() if with_entropy else None), []
    multiples = length_multiples(context, fp8_multiple)
    groups = plan_groups(batch, batching, multiples)
    count, longest = agree_forward_pass(groups, context)
    if count == 0:  # no rank has a sequence
        empty = torch.zeros(0, s)
        return empty, (empty.clone() if with_entropy else None), []
    if context.vpp_size is not None:  # the interleaved schedule wants whole groups of PP
        count = -(-max(count, context.pp_size) // context.pp_size) * context.pp_size
    microbatches = build_microbatches(
        batch, groups, batching, multiples, count, agreed_row_length(groups, context, longest)
    )

    def per_microbatch(microbatch: PolicyBatch, logits: StageLogits):
        logprobs, entropy = token_logprobs(
            logits, microbatch.tokens, context, temperature=temperature, with_entropy=with_entropy
        )
        # 0 off the response, whether or not this layout computed those positions
        mask = microbatch.response_mask.to(logprobs.device)
        outputs = {"logprobs": torch.where(mask, logprobs, 0.0).float()}
        if with_entropy:
            outputs["entropy"] = torch.where(mask, entropy, 0.0).float()
        return logprobs.sum(), outputs

    outputs = run_schedule(
        chunks,
        microbatches,
        per_microbatch,
        context,
        forward_only=True,
        before_forward=None if routing is None else routing.before_forward,
    )
    # Every micro-batch's [b, T_m] values, flattened into one tensor for one broadcast (packed
    # rows differ in length where no pipeline needs them equal).
    keys = ("logprobs", "entropy") if with_entropy else ("logprobs",)
    sizes = [mb.tokens.numel() for mb in microbatches]
    if context.is_last_stage():
        flat = torch.cat([out[key].reshape(-1) for key in keys for out in outputs])
    else:
        flat = torch.empty(len(keys) * sum(sizes), device=context.device)
    if context.pp_size > 1:
        dist.broadcast(flat, src=last_stage_rank(context), group=context.pp_group)
    flat = flat.cpu()
    result = []
    for part in flat.split(sum(sizes)):
        values = [v.view(mb.tokens.shape) for v, mb in zip(part.split(sizes), microbatches)]
        if microbatches[0].segments is not None:  # packed rows back into [n, s]
            result.append(unpack_tokens(values, microbatches, (n, s)))
        else:
            result.append(torch.cat(values)[:n, :s])
    return result[0], (result[1] if with_entropy else None), microbatches
