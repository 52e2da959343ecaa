"""Parameter counts of simulated ranks' shards: the experts a rank holds, and the distinct
parameters of all shards together (each tensor once, however many ranks hold a copy), which must
add up to the model's total.

A parameter is an expert's when it lives under a layer's ``mlp.experts`` (Megatron's
``SequentialMLP``); its attribute ``allreduce`` cannot tell, since Megatron sets it only when
expert parallelism is on. A dense parameter is split over the tensor-parallel group when Megatron
marks it ``tensor_model_parallel`` (each TP rank's piece is distinct) and replicated otherwise
(norms, the router: one copy counts). A tied output layer on the last of several pipeline stages
(``shared_embedding``) is a copy of the first stage's embedding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Chunks = Sequence[torch.nn.Module]


def is_expert_weight(name: str) -> bool:
    """Whether the parameter called ``name`` in a model chunk belongs to an expert."""
    return ".mlp.experts." in f".{name}"


def _named(chunks: Chunks):
    for chunk in chunks:
        yield from getattr(chunk, "module", chunk).named_parameters()


def expert_parameter_count(chunks: Chunks) -> int:
    """Expert parameters in a rank's chunks."""
    return sum(p.numel() for name, p in _named(chunks) if is_expert_weight(name))


def distinct_parameters(
    dense: Mapping[int, Mapping[int, Chunks]],
    experts: Mapping[int, Mapping[int, Mapping[int, Chunks]]],
) -> int:
    """Distinct parameters of every stage's shards: ``dense[pp_rank][tp_rank]`` (one
    data-parallel replica; their expert parameters are ignored) and
    ``experts[pp_rank][ep_rank][etp_rank]`` (expert data-parallel rank 0; only their expert
    parameters are counted)."""
    total = 0
    for pp_rank, by_tp in dense.items():
        for tp_rank, chunks in by_tp.items():
            for name, param in _named(chunks):
                if is_expert_weight(name):
                    continue
                if pp_rank > 0 and getattr(param, "shared_embedding", False):
                    continue  # the last stage's copy of the tied embedding
                if tp_rank == 0 or getattr(param, "tensor_model_parallel", False):
                    total += param.numel()
    for by_ep in experts.values():
        for by_etp in by_ep.values():
            total += sum(expert_parameter_count(chunks) for chunks in by_etp.values())
    return total
