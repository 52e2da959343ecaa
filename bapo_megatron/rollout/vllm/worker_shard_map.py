"""A vLLM worker's shard map, read off vLLM's own weight loaders (written for vLLM 0.32).

Inside a worker, :func:`probe_shard_map` gives every checkpoint-format parameter of the model a
float64 stand-in filled with -1 (the shapes and loaders vLLM recorded before processing the
weights for its kernels, the same record its in-place reload restores from), loads each HF tensor
through the model's own ``load_weights`` as a float64 tensor whose every element holds its flat
index + 1, and reads where each element landed (:mod:`bapo_megatron.models.shard_probe`). The live
parameters are put back untouched. The stand-ins take 8 bytes per element of the worker's
parameters while the probe runs. It imports ``vllm`` lazily: it runs inside vLLM's worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from bapo_megatron.models.shard_map import Fill, Region, ShardMap
from bapo_megatron.models.shard_probe import UNWRITTEN, observed_parts


def probe_shard_map(model: torch.nn.Module, hf_shapes: Mapping[str, Sequence[int]]) -> dict:
    """Where vLLM's loaders put each HF tensor of ``hf_shapes`` in ``model`` (a worker's model),
    as plain data (:func:`shard_map_from_probe` reads it back): ``regions`` and ``fills`` (tuples
    of :class:`Region` / :class:`Fill` fields), ``local_shapes`` of the parameters written and
    ``unwritten`` (HF tensors no loader wrote here). ``ValueError`` when a loader changes values
    (casts, scales, quantizes): such a tensor cannot be sent as raw elements."""
    regions: list[Region] = []
    fills: dict[tuple, Fill] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    unwritten = []
    with _standins(model) as (standins, touched):
        for hf, shape in hf_shapes.items():
            numel = int(np.prod(shape))
            indices = torch.arange(1, numel + 1, dtype=torch.float64).reshape(tuple(shape))
            touched.clear()
            with torch.no_grad():
                model.load_weights(iter([(hf, indices)]))
            if not touched:
                unwritten.append(hf)
            for local in sorted(touched):
                standin = standins[local]
                found, filled = observed_parts(hf, shape, local, standin.detach().numpy())
                regions.extend(found)
                fills.update((tuple(f), f) for f in filled)
                shapes[local] = tuple(standin.shape)
                standin.data.fill_(UNWRITTEN)
        stray = [name for name, t in standins.items() if (t != UNWRITTEN).any()]
        if stray:
            raise ValueError(f"vLLM's loaders wrote {stray} outside their weight loaders")
    return {
        "regions": [tuple(r) for r in regions],
        "fills": [tuple(f) for f in fills.values()],
        "local_shapes": sorted((name, list(shape)) for name, shape in shapes.items()),
        "unwritten": unwritten,
    }


def shard_map_from_probe(report: Mapping[str, Any], rank: int) -> ShardMap:
    """The :class:`ShardMap` of a :func:`probe_shard_map` report, as ``rank`` of the weight
    group (replication is marked across ranks:
    :func:`~bapo_megatron.models.shard_probe.mark_replicated`)."""
    return ShardMap(
        rank,
        tuple(Region(*fields) for fields in report["regions"]),
        tuple(Fill(*fields) for fields in report["fills"]),
        tuple((name, tuple(shape)) for name, shape in report["local_shapes"]),
    )


@contextmanager
def _standins(model: torch.nn.Module) -> Iterator[tuple[dict[str, torch.Tensor], set[str]]]:
    """Swap every parameter of ``model`` for a float64 stand-in of its checkpoint format (filled
    with :data:`UNWRITTEN`, whose loader also records that it ran); yields the stand-ins by
    name and the set of names loaded since it was last cleared; restores the live parameters."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    standins: dict[str, torch.Tensor] = {}
    touched: set[str] = set()
    saved: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    try:
        for prefix, layer in model.named_modules():
            info = LAYERWISE_INFO.get(layer)
            recorded = info.restore_metadata[0] if info is not None else {}
            # a bias is built after the layer's weights and never recorded: it is loaded as is
            names = [*recorded, *(n for n in layer._parameters if n not in recorded)]
            if not names:
                continue
            saved.append((layer, dict(layer._parameters)))
            for name in names:
                template = recorded.get(name, layer._parameters.get(name))
                if template is None:
                    continue
                local = f"{prefix}.{name}" if prefix else name
                standin = torch.full(tuple(template.shape), UNWRITTEN, dtype=torch.float64)
                standin.__class__ = template.__class__
                standin.__dict__ = template.__dict__.copy()
                restore_layer_refs(standin, layer)
                loader = getattr(standin, "weight_loader", default_weight_loader)
                # an in-place reload leaves its deferring wrapper on the recorded parameters
                while getattr(loader, "__name__", "") == "online_process_loader":
                    loader = loader.__wrapped__
                standin.weight_loader = _recording(loader, local, touched)
                layer._parameters[name] = standin
                standins[local] = standin
        yield standins, touched
    finally:
        for layer, parameters in saved:
            layer._parameters.clear()
            layer._parameters.update(parameters)


def _recording(loader: Callable, name: str, touched: set[str]) -> Callable:
    signature = inspect.signature(loader)

    def load(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("param") is None:
            raise ValueError(f"vLLM loader of {name!r} takes no `param` argument")
        touched.add(name)
        return loader(*args, **kwargs)

    return load
