"""What Megatron-Core keeps of a model after the model is dropped, let go with it (megatron-core
0.16.1; on CPU and GPU).

Three places in Megatron-Core hold a built model, or what it reaches (its ``ParallelContext``,
process groups and gloo threads), for the rest of the process: the class-level list of every
``RouterReplay`` made, the class-level ``lru_cache`` on ``RotaryEmbedding.forward``, and the
tensors an MoE layer's token dispatcher keeps of its last forward, whose autograd graph loops
back to the model. :func:`release_with_the_model` is applied to every chunk ``build_model``
builds. Each step only touches what the chunk holds and does nothing where its site is absent
(no router replay, no rotary embedding, no lru_cache on the class, no MoE layer).
This folder's ``README.md`` lists them.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay


def release_with_the_model(chunk: torch.nn.Module) -> None:
    """Apply the three steps below to one model chunk, right after it is built."""
    unregister_router_replays(chunk)
    rotary_cache_of_its_own(chunk)
    for module in chunk.modules():
        if isinstance(module, BaseMoELayer):
            module.register_forward_hook(drop_dispatcher_graph)


def unregister_router_replays(chunk: torch.nn.Module) -> None:
    """Take the chunk's routers' ``RouterReplay`` objects out of Megatron's class-level list of
    every one ever made (``RouterReplay.global_router_replay_instances``, never emptied). Each
    router keeps its own, which is the one routing replay drives; left in the list, they would
    keep whatever they reach (the routing replay, the model, its process groups) alive for the
    rest of the process."""
    mine = {
        id(module.router_replay)
        for module in chunk.modules()
        if isinstance(module, TopKRouter) and module.router_replay is not None
    }
    if mine:
        registry = RouterReplay.global_router_replay_instances
        registry[:] = [replay for replay in registry if id(replay) not in mine]


def rotary_cache_of_its_own(chunk: torch.nn.Module) -> None:
    """Megatron caches ``RotaryEmbedding.forward`` in one ``lru_cache`` on the class, keyed by
    the module: the last 32 rotary embeddings, and the context-parallel group each holds,
    outlive their models. Give the chunk's rotary embedding the same cache as an attribute of
    its own, which goes when the model goes."""
    rotary = getattr(chunk, "rotary_pos_emb", None)
    cached = getattr(type(rotary), "forward", None)
    if rotary is not None and hasattr(cached, "cache_clear"):
        uncached = cached.__wrapped__.__get__(rotary)
        rotary.forward = functools.lru_cache(maxsize=cached.cache_info().maxsize)(uncached)


def drop_dispatcher_graph(layer: BaseMoELayer, args, output) -> None:
    """Forward hook of an MoE layer: drop what its token dispatcher keeps of the forward with an
    autograd graph (the router probabilities, used by the combine step that has run by now).
    Kept, that graph leads to the parameters' gradient hooks, which hold the DDP wrapper and so
    the model: a loop through autograd's own objects that the garbage collector does not see,
    which would keep the model and its process groups alive after the model is dropped. A call
    that runs only the first phases of the layer (Megatron's partial CUDA graphs) keeps them for
    the next call."""
    if layer.token_dispatcher is None or "postprocess" not in layer.fwd_execution_map:
        return
    kept = vars(layer.token_dispatcher)
    for name, value in list(kept.items()):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            kept[name] = None
