"""Routing replay: the actor's routers forced to given experts (R3: the rollout engine's; R2: the
ones recorded in the actor's own old-log-prob pass), or recorded.

Routes are per token: ``routes[i, t, l, :]`` are the ``num_experts_per_tok`` global expert ids
that token t of sequence i (as an input of the model, column-aligned with ``tokens``) was sent to
in the l-th MoE layer (counted over the model's MoE layers only, from 0). A row of -1 is a
missing route (the last sampled token, which the engine never ran; prompt tokens when the engine
gives none; padding): that token is routed live. A row must be all -1 or all valid, its ids in
[0, num_experts) and distinct; anything else is refused with the sequence, token and layer.

The mechanism is Megatron's own (``TransformerConfig.moe_enable_routing_replay``): each router
owns a ``RouterReplay`` whose ``get_replay_topk`` returns the target indices (REPLAY_FORWARD) or
pops them from a FIFO filled by every forward (REPLAY_BACKWARD, for activation recompute, whose
second forward must route as the first did); it gathers the router's scores at those experts,
so the router still gets gradients. Two things are added here, per router instance: rows of -1
take the live top-k (Megatron's would index with -1), and the action is chosen per call: a
router that runs with gradients enabled while the actor recomputes activations is in the
recompute pass (Megatron runs the first pass of a checkpointed block without gradients).

Placement: a router sees its micro-batch's tokens sequence-major ([s, b] flattened), under
sequence parallelism only its tensor-parallel rank's slice of the sequence, and a pipeline
stage holds only its layers; :meth:`RoutingReplay.before_forward` cuts the micro-batch's routes
accordingly for the routers of the chunk about to run. Recorded routes are merged back into
``[n, s, moe_layers, topk]`` on every rank (all-reduce MAX over the tensor and pipeline groups
of tensors that are -1 outside a rank's own part).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.config import ModelConfig
from bapo_megatron.distributed.context import ParallelContext

MISSING = -1
"""Expert id of a missing route (the whole row is MISSING)."""


def validate_routes(routes: torch.Tensor, model: ModelConfig, where: str = "routes") -> None:
    """Refuse routes this model cannot replay, naming the sequence, token and MoE layer: wrong
    shape or dtype, ids out of [0, num_experts), a row mixing valid ids and -1, or the same
    expert twice in one row (Megatron would silently send the token to it once)."""
    moe = model.moe
    if moe is None:
        raise ValueError(f"{where}: model.model_type {model.model_type!r} has no experts")
    layers, topk = moe.num_moe_layers(model.num_layers), moe.num_experts_per_tok
    if routes.dim() != 4 or tuple(routes.shape[2:]) != (layers, topk):
        raise ValueError(
            f"{where}: expected [sequences, tokens, {layers} MoE layers, top-{topk}], got "
            f"{tuple(routes.shape)}"
        )
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"{where}: expected integer expert ids, got {routes.dtype}")

    def first(bad: torch.Tensor, what: str) -> None:
        if bool(bad.any()):
            i, t, layer = (int(x) for x in bad.nonzero()[0][:3])
            raise ValueError(
                f"{where}: sequence {i}, token {t}, MoE layer {layer}: {what} "
                f"({routes[i, t, layer].tolist()})"
            )

    missing = routes == MISSING
    first(
        missing.any(-1) & ~missing.all(-1),
        "a route mixes expert ids and -1 (a row is all -1 or all valid)",
    )
    first(
        (~missing & ((routes < 0) | (routes >= moe.num_experts))).any(-1),
        f"expert id out of range [0, {moe.num_experts})",
    )
    ordered = routes.sort(dim=-1).values
    first(
        ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != MISSING)).any(-1),
        "the same expert twice (pad routes with distinct ids)",
    )


class RoutingReplay:
    """Replay or record the routes of this rank's routers (``moe_enable_routing_replay``)."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        model: ModelConfig,
        context: ParallelContext,
        *,
        recompute: bool,
    ):
        self.model = model
        self.context = context
        self.recompute = recompute
        pattern = model.moe.moe_layer_pattern(model.num_layers)
        moe_index = {layer: sum(pattern[:layer]) for layer in range(model.num_layers)}
        self.num_layers = sum(pattern)
        self.topk = model.moe.num_experts_per_tok
        # (chunk, router, its MoE-layer index)
        self._routers: list[tuple[torch.nn.Module, TopKRouter, int]] = []
        for chunk in chunks:
            chunk = _unwrapped(chunk)
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.router_replay is None:
                        raise AssertionError("routers need moe_enable_routing_replay")
                    self._routers.append((chunk, module, moe_index[module.layer_number - 1]))
                    module.router_replay.get_replay_topk = functools.partial(
                        _replay_topk, module.router_replay, self, len(self._routers) - 1
                    )
        self._mode: str | None = None
        self._recorded: list[list[torch.Tensor]] = [[] for _ in self._routers]

    # ---------------------------------------------------------------- modes

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Force the routers to the routes of each micro-batch (``before_forward``) inside."""
        with self._mode_set("replay"):
            yield

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the routers' live choices inside; :meth:`recorded_routes` gives them."""
        self._recorded = [[] for _ in self._routers]
        with self._mode_set("record"):
            yield

    @contextlib.contextmanager
    def _mode_set(self, mode: str) -> Iterator[None]:
        if self._mode is not None:
            raise RuntimeError(f"routing replay: already {self._mode}ing")
        self._mode = mode
        for _, router, _ in self._routers:
            router.router_replay.clear_indices()
        try:
            yield
        finally:
            self._mode = None
            for _, router, _ in self._routers:  # entries no recompute consumed
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    # ---------------------------------------------------------------- feeding

    def before_forward(self, microbatch: PolicyBatch, chunk: torch.nn.Module) -> None:
        """Set the targets of ``chunk``'s routers to ``microbatch``'s routes (all live where it
        has none), in the order the routers see the tokens."""
        if self._mode != "replay":
            return
        routes = microbatch.routes
        chunk = _unwrapped(chunk)
        for owner, router, layer in self._routers:
            if owner is not chunk:
                continue
            if routes is None:
                b, s = microbatch.tokens.shape
                rows = torch.full((s, b, self.topk), MISSING, dtype=torch.long)
            else:
                rows = routes[:, :, layer, :].transpose(0, 1).long()  # [s, b, k]
            rows = self._sequence_slice(rows)
            router.router_replay.set_target_indices(rows.reshape(-1, self.topk))

    def _sequence_slice(self, rows: torch.Tensor) -> torch.Tensor:
        if self.context.config.sequence_parallel:
            return rows.chunk(self.context.tp_size, dim=0)[self.context.tp_rank]
        return rows

    # ---------------------------------------------------------------- recording

    def recorded_routes(self, microbatches: list[PolicyBatch], rows: int) -> torch.Tensor:
        """``[rows, s, moe_layers, topk]`` routes of the first ``rows`` rows of the recorded pass
        over ``microbatches`` (s: the longest micro-batch's length; -1 past a shorter one's),
        the same on every rank of the model replica (collective over the tensor and pipeline
        groups)."""
        b = microbatches[0].tokens.shape[0]
        s = max(mb.tokens.shape[1] for mb in microbatches)  # packed rows may differ in length
        count = len(microbatches)
        full = torch.full(
            (count * b, s, self.num_layers, self.topk),
            MISSING,
            dtype=torch.long,
            device=self.context.device,  # NCCL reduces device tensors only
        )
        for index, (_, _, layer) in enumerate(self._routers):
            recorded = self._recorded[index]
            if len(recorded) != count:
                raise AssertionError(
                    f"routing replay: {len(recorded)} recorded passes for {count} micro-batches"
                )
            for m, indices in enumerate(recorded):
                length = microbatches[m].tokens.shape[1]
                sp = self.context.config.sequence_parallel
                per_rank = length // self.context.tp_size if sp else length
                start = self.context.tp_rank * per_rank if sp else 0
                part = indices.view(per_rank, b, self.topk).transpose(0, 1)  # [b, s_local, k]
                full[m * b : (m + 1) * b, start : start + per_rank, layer] = part
        for group, size in (
            (self.context.tp_group, self.context.tp_size),
            (self.context.pp_group, self.context.pp_size),
        ):
            if size > 1:
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group)
        return full[:rows].cpu()


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):  # DDP and other wrappers
        chunk = chunk.module
    return chunk


def _replay_topk(
    replay: RouterReplay,
    owner: RoutingReplay,
    index: int,
    scores: torch.Tensor,
    topk: int,
    num_groups=None,
    group_topk=None,
    default_compute_topk=None,
):
    """``RouterReplay.get_replay_topk`` of one router, with live routing for missing rows and
    the action chosen per call (see the module docstring)."""
    mode = owner._mode
    if mode is None:
        return default_compute_topk(scores, topk, num_groups, group_topk)
    recomputing = _inside_recompute(owner)
    if mode == "record":
        replay.set_router_replay_action(RouterReplayAction.RECORD)
        probs, indices = RouterReplay.get_replay_topk(
            replay, scores, topk, num_groups, group_topk, default_compute_topk
        )
        if not recomputing:
            owner._recorded[index].append(indices.detach().clone())
        return probs, indices
    if recomputing:
        replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        target = replay.replay_backward_list[0]
    else:
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        target = replay.target_topk_idx
    target = target.to(scores.device)
    if target.shape != (scores.shape[0], topk):
        raise AssertionError(
            f"routing replay: routes for {tuple(target.shape)} tokens x top-k, the router has "
            f"{scores.shape[0]} tokens x top-{topk}"
        )
    missing = (target == MISSING).all(-1, keepdim=True)
    if bool(missing.any()):
        _, live = default_compute_topk(scores, topk, num_groups, group_topk)
        target = torch.where(missing, live, target)
    if recomputing:
        replay.replay_backward_list[0] = target
    else:
        replay.target_topk_idx = target
    return RouterReplay.get_replay_topk(
        replay, scores, topk, num_groups, group_topk, default_compute_topk
    )


def _inside_recompute(owner: RoutingReplay) -> bool:
    """Megatron runs a checkpointed block's first forward without gradients and its recompute
    (in the backward pass) with them: with recompute on, a router forward with gradients
    enabled is the recompute."""
    return owner.recompute and torch.is_grad_enabled()
