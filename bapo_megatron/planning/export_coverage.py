"""Whether the live weight export of a layout would hand the rollout engine the whole model: the
export's own plan (:func:`~bapo_megatron.weights.export.plan_buckets` over the name map's rules)
run on every pipeline stage's meta shards, without moving a byte.

Each stage exports the rules of the parameters it holds; the whole HF tensors of a rule are put
together from the tensor-parallel ranks' shards as the transports do (each rank's
:func:`~bapo_megatron.models.name_maps.split` pieces side by side along ``tp_dim``, or one
rank's piece for a replicated tensor). A mixture-of-experts model's experts are exported apart,
as :func:`~bapo_megatron.weights.export.export_weights` does: each expert-parallel rank of a stage
(at expert data-parallel rank 0) plans the buckets of the experts it holds, their shards put
together over its expert tensor-parallel group. The check: over all stages, every HF tensor of
the model comes out exactly once, with its full shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.models.name_maps import chunk_parameters, name_map_for, split
from bapo_megatron.weights.export import plan_buckets

StageShards = Mapping[int, Sequence[torch.nn.Module]]
"""One stage's chunks per tensor-parallel rank."""
StageExperts = Mapping[int, Mapping[int, Sequence[torch.nn.Module]]]
"""One stage's chunks per expert-parallel rank, then per expert tensor-parallel rank."""


@dataclass
class ExportCoverage:
    """What the export plan of all stages yields, against the model's HF tensors."""

    tensors: int = 0
    """HF tensors the model has (the tied output layer is not one)."""
    buckets: int = 0
    """Buckets over all stages."""
    missing: list[str] = field(default_factory=list)
    """HF tensors no stage exports."""
    duplicated: list[str] = field(default_factory=list)
    """HF tensors more than one stage exports."""
    wrong_shape: list[str] = field(default_factory=list)
    """``name: assembled shape != expected`` for tensors whose shards do not add up."""

    @property
    def complete(self) -> bool:
        """Every HF tensor exactly once with its full shape."""
        return not (self.missing or self.duplicated or self.wrong_shape)


def assembled_shapes(rule, shards: Sequence[torch.Tensor], model: ModelConfig):
    """Shapes of the whole HF tensors of ``rule`` assembled from the TP ranks' ``shards``."""
    pieces = [split(rule, shard, model) for shard in shards]
    shapes = []
    for index in range(len(rule.hf)):
        shape = list(pieces[0][index].shape)
        if rule.tp_dim is not None:
            shape[rule.tp_dim] = sum(p[index].shape[rule.tp_dim] for p in pieces)
        elif any(p[index].shape != pieces[0][index].shape for p in pieces):
            shape = [-1]  # replicated shards that disagree
        shapes.append(tuple(shape))
    return shapes


def check_export(
    stages: Mapping[int, StageShards],
    model: ModelConfig,
    bucket_bytes: int,
    experts: Mapping[int, StageExperts] | None = None,
) -> ExportCoverage:
    """The export plan of every pipeline stage (``stages[pp_rank][tp_rank]`` = that rank's
    chunks; for an MoE model ``experts[pp_rank][ep_rank][etp_rank]`` too) at ``bucket_bytes``
    per bucket, checked against the name map's HF tensors."""
    name_map = name_map_for(model.model_type)
    rules = name_map.rules(model)
    expected = name_map.hf_shapes(model)
    element_size = torch.empty((), dtype=getattr(torch, model.params_dtype)).element_size()
    seen: Counter[str] = Counter()
    coverage = ExportCoverage(tensors=len(expected))

    def cover(by_rank: Mapping[int, Sequence[torch.nn.Module]], expert_rules: bool) -> None:
        params_per_rank = [
            {name: p for chunk in chunks for name, p in chunk_parameters(chunk)}
            for _, chunks in sorted(by_rank.items())
        ]
        owned = [
            rule
            for rule in rules
            if rule.megatron in params_per_rank[0]
            # without expert shards of their own (a dense model) a stage's shards export all
            and (experts is None or (rule.expert is not None) == expert_rules)
        ]
        buckets = plan_buckets(owned, model, bucket_bytes, element_size)
        coverage.buckets += len(buckets)
        for bucket in buckets:
            for rule in bucket:
                shards = [params[rule.megatron] for params in params_per_rank]
                for name, shape in zip(rule.hf, assembled_shapes(rule, shards, model)):
                    seen[name] += 1
                    if expected.get(name) not in (None, shape):
                        coverage.wrong_shape.append(f"{name}: {shape} != {expected[name]}")

    for pp_rank, by_tp in sorted(stages.items()):
        cover(by_tp, expert_rules=False)
        for _, by_etp in sorted((experts or {}).get(pp_rank, {}).items()):
            cover(by_etp, expert_rules=True)
    coverage.missing = sorted(set(expected) - set(seen))
    coverage.duplicated = sorted(name for name, count in seen.items() if count > 1)
    coverage.wrong_shape += sorted(
        f"{name}: not an HF tensor" for name in set(seen) - set(expected)
    )
    return coverage
