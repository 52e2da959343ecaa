"""The load-balancing auxiliary loss of a mixture-of-experts actor: a term the training step adds
to the BAPO loss, with explicit scaling.

For one MoE layer and the real (non-padding) tokens B of one micro-batch, with E experts, top-k
routing, router scores s_te = softmax(router logits)_te over all experts, and the live top-k
choice of each token (Switch Transformer; Megatron's and transformers' form):

    L = E * sum_e f_e * P_e,   f_e = |{t in B: e in topk(s_t)}| / (k |B|),
                               P_e = sum_{t in B} s_te / |B|

(1 when tokens spread evenly). Gradients flow through P only. The step's term is

    aux = sum over micro-batches mb of the step (every data-parallel rank) of
          (|B_mb| / |B_step|) * sum over MoE layers of L_mb,layer

and ``router_aux_loss_coef * aux`` is what the step minimizes besides the BAPO loss. Weighting
by the micro-batch's share of the step's tokens makes the term independent of how the step's
sequences are spread over data-parallel ranks, as long as each sequence's micro-batch holds the
same sequences (the distributed tests rely on this).

Why not Megatron's own: its router attaches the loss times the micro-batch's token count and
leaves the division by the step's tokens to ``finalize_model_grads``, which this actor tells not
to scale (the BAPO loss arrives normalized). So Megatron's loss is switched off
(``moe_router_load_balancing_type="none"``) and a forward hook on each router computes L from
the router's input and attaches ``coef * weight * L`` to the router's output probabilities with
an autograd function that adds its gradient in the backward pass (the loss lives on the layer's
pipeline stage; the BAPO loss only on the last one).

Placement: under sequence parallelism a router sees its tensor-parallel rank's slice of the
sequence; token counts are summed over the tensor-parallel group and each rank's P covers its
own tokens, so the ranks' L add up to the micro-batch's, and Megatron sums the router weight's
gradient over that group (its ``sequence_parallel`` attribute).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.distributed.context import ParallelContext

Reduce = Callable[[torch.Tensor], torch.Tensor]


def load_balancing_loss(
    scores: torch.Tensor, valid: torch.Tensor, topk: int, reduce: Reduce
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, tokens)`` for one layer: ``scores`` [T, E] router probabilities (softmax over every
    expert) of this rank's tokens, ``valid`` [T] bool (padding excluded), ``reduce`` the sum
    over the ranks holding the rest of the micro-batch's tokens (identity in one process).
    Returns this rank's share of L (the shares of the ranks add up to L) and the micro-batch's
    token count |B| (the same on every rank). L is 0 for a micro-batch without tokens."""
    num_experts = scores.shape[-1]
    weight = valid.to(scores.dtype)
    chosen = torch.zeros_like(scores).scatter_(1, scores.topk(topk, dim=1).indices, 1.0)
    counts = torch.cat([(chosen * weight[:, None]).sum(0), weight.sum()[None]]).detach()
    counts = reduce(counts)
    per_expert, tokens = counts[:-1], counts[-1]
    if float(tokens) == 0:
        return scores.sum() * 0.0, tokens
    fraction = per_expert / (topk * tokens)
    probability = (scores * weight[:, None]).sum(0) / tokens
    return num_experts * (fraction * probability).sum(), tokens


class _AddLossInBackward(torch.autograd.Function):
    """Identity on ``output``; in the backward pass ``term`` gets gradient 1, so whatever
    ``term`` was computed from gets d term / d parameters added to its gradients."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_shape = term.shape
        ctx.term_dtype = term.dtype
        ctx.term_device = term.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, torch.ones(ctx.term_shape, dtype=ctx.term_dtype, device=ctx.term_device)


def valid_tokens_sequence_major(microbatch: PolicyBatch, context: ParallelContext) -> torch.Tensor:
    """[tokens] bool in the order a router of this rank sees them: the [s, b] sequence-major
    layout flattened (token (s, b) at s * b_size + b), this tensor-parallel rank's slice of the
    sequence under sequence parallelism. A position is real when it is before the end of its
    sequence's last response token (padding rows and right padding are not; in a packed row,
    the tokens its sequences keep)."""
    if microbatch.segments is not None:  # a packed row: its sequences' own tokens
        valid = microbatch.segments.real_tokens()[:, None]  # [s, b = 1]
    else:
        mask = microbatch.response_mask
        positions = torch.arange(mask.shape[1])
        last = torch.where(mask, positions, -1).amax(dim=1)  # -1: no response token
        valid = (positions[None, :] <= last[:, None]).t()  # [s, b]
    if context.config.sequence_parallel:
        valid = valid.chunk(context.tp_size, dim=0)[context.tp_rank]
    return valid.reshape(-1)


class MoeAuxLoss:
    """The aux-loss term of one actor: forward hooks on its routers that are active only inside
    :meth:`training_step`, fed each micro-batch by :meth:`before_forward`."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        coef: float,
        context: ParallelContext,
        *,
        recompute: bool = False,
    ):
        self.coef = coef
        self.context = context
        self.recompute = recompute
        # A pipeline stage may hold no MoE layer (mlp_only_layers); it still joins the
        # reductions of step_value.
        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self._step_tokens: float | None = None
        self._valid: torch.Tensor | None = None
        self._sum = torch.zeros((), dtype=torch.float64)
        # With activation recompute, a router's first forward (no gradients) and its recompute
        # in the backward pass are apart: 1F1B runs other micro-batches' forwards in between.
        # Each router queues the token flags of its first forwards for its recomputes.
        self._queued: dict[int, list[torch.Tensor]] = {id(r): [] for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._hook)

    @property
    def num_layers(self) -> int:
        """MoE layers on this rank."""
        return len(self.routers)

    def before_forward(self, microbatch: PolicyBatch, chunk: torch.nn.Module | None = None) -> None:
        """Record which tokens of the micro-batch about to run are real (called by the
        schedule's forward step on every stage, right before the model)."""
        self._valid = valid_tokens_sequence_major(microbatch, self.context)

    @contextlib.contextmanager
    def training_step(self, step_tokens: float) -> Iterator[None]:
        """Attach the term in the forward passes inside (with gradients enabled), for a step of
        ``step_tokens`` real tokens over every micro-batch and data-parallel rank."""
        self._step_tokens = float(step_tokens)
        self._sum = torch.zeros((), dtype=torch.float64)
        try:
            yield
        finally:
            self._step_tokens = None
            self._valid = None
            for queue in self._queued.values():
                queue.clear()

    def step_value(self) -> float:
        """The last step's aux (before the coefficient), summed over micro-batches, MoE layers
        and every rank: the same on every rank. Collective over tensor, pipeline and data x
        context parallel groups."""
        total = self._sum.to(self.context.device)  # NCCL reduces device tensors only
        for group, size in (
            (self.context.tp_group, self.context.tp_size if self._sp else 1),
            (self.context.pp_group, self.context.pp_size),
            (self.context.dp_cp_group, self.context.dp_cp_size),
        ):
            if size > 1:
                dist.all_reduce(total, group=group)
        return float(total)

    @property
    def _sp(self) -> bool:
        return self.context.config.sequence_parallel

    def _reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self._sp and self.context.tp_size > 1:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.context.tp_group)
        return counts

    def _hook(self, router: torch.nn.Module, args: tuple, output):
        if self._step_tokens is None or self._valid is None:
            return output
        if not torch.is_grad_enabled():  # a checkpointed block's first forward (or no training)
            if self.recompute:
                self._queued[id(router)].append(self._valid)
            return output
        valid = self._queued[id(router)].pop(0) if self.recompute else self._valid
        probs, routing_map = output
        hidden = args[0]
        logits = router.gating(hidden).view(-1, router.config.num_moe_experts)
        scores = torch.softmax(logits.float(), dim=-1)
        valid = valid.to(scores.device)
        if valid.numel() != scores.shape[0]:
            raise AssertionError(
                f"aux loss: {valid.numel()} token flags for {scores.shape[0]} routed tokens"
            )
        share, tokens = load_balancing_loss(scores, valid, router.topk, self._reduce_counts)
        weight = float(tokens) / self._step_tokens if self._step_tokens > 0 else 0.0
        self._sum += weight * float(share.detach())
        term = (self.coef * weight) * share
        return _AddLossInBackward.apply(probs, term), routing_map
