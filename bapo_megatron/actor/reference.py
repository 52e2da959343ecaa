"""The frozen reference policy of a KL term: the actor's model built a second time on the
actor's layout (same TP/PP/EP/VPP ranks, so its shards line up with the actor's), without
gradients, optimizer or data-parallel wrapper. Its log-probs are one more forward-only pass of
the old-log-prob phase; with ``offload`` its weights wait in host memory between passes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel

from bapo_megatron.actor.actor import Actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.actor.model import build_model
from bapo_megatron.distributed.context import ParallelContext

HOST = torch.device("cpu")


@dataclass
class ReferencePolicy:
    """This rank's chunks of the reference model."""

    chunks: list[torch.nn.Module]
    context: ParallelContext
    offload: bool
    """Whether the weights live in host memory between passes."""

    def logprobs(
        self, batch: PolicyBatch, *, batching: Batching, temperature: float, fp8_multiple: int = 1
    ) -> torch.Tensor:
        """``[n, s]`` log-probs of ``batch``'s tokens under the reference, on the CPU on every
        rank of the pipeline (0 off the response), as
        :func:`~bapo_megatron.actor.logprobs.compute_logprobs` gives the actor's."""
        with self.on_device():
            logprobs, _ = compute_logprobs(
                self.chunks,
                batch,
                self.context,
                batching=batching,
                temperature=temperature,
                with_entropy=False,
                fp8_multiple=fp8_multiple,
            )
        return logprobs

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The weights on the actor's device for the block (moved there and back when
        offloaded)."""
        if not self.offload or self.context.device == HOST:
            yield
            return
        for chunk in self.chunks:
            chunk.to(self.context.device)
        try:
            yield
        finally:
            for chunk in self.chunks:
                chunk.to(HOST)
            if self.context.device.type == "cuda":
                torch.cuda.empty_cache()

    def to_host_if_offloaded(self) -> None:
        """After the weights were loaded: into host memory, if offloaded."""
        if self.offload:
            for chunk in self.chunks:
                chunk.to(HOST)

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards by the names :meth:`Actor.named_parameters` uses."""
        prefix = len(self.chunks) > 1
        return {
            (f"chunk{i}." if prefix else "") + name: param
            for i, chunk in enumerate(self.chunks)
            for name, param in chunk.named_parameters()
        }


def build_reference(actor: Actor, *, offload: bool) -> ReferencePolicy:
    """An uninitialised reference model on ``actor``'s layout (the caller loads its weights:
    :func:`copy_actor_weights` or a checkpoint loader). The global random state is left as it
    was: building the reference does not change what the run draws afterwards."""
    context = actor.context
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker_states = tracker.get_states()
    devices = [context.device] if context.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        chunks = build_model(
            actor.model_config,
            context.config,
            context,
            seed=actor.actor_config.seed,
            initialize=False,
        )
    tracker.set_states(tracker_states)
    for chunk in chunks:
        chunk.requires_grad_(False)
    return ReferencePolicy(chunks=list(chunks), context=context, offload=offload)


@torch.no_grad()
def copy_actor_weights(reference: ReferencePolicy, actor: Actor) -> None:
    """The actor's current weights into ``reference`` (shard by shard: same layout)."""
    mine = reference.parameters()
    theirs = actor.named_parameters()
    if mine.keys() != theirs.keys():
        raise AssertionError("the reference model's parameters differ from the actor's")
    for name, param in mine.items():
        param.copy_(theirs[name].detach())
