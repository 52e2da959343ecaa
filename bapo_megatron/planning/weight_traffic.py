"""Weight-sync traffic of a layout on paper: the bytes each trainer rank sends and each engine
rank receives per update, and the messages, for the broadcast path and for shard-to-shard.

The trainer's shard maps come from the simulated ranks' meta shards (their parameters'
tensor-parallel attributes, :func:`~bapo_megatron.models.trainer_shards.chunk_placements`);
every other rank of the world holds what the simulated rank at its coordinates holds. The engine
is vLLM at ``engine_tp`` workers per replica (:mod:`bapo_megatron.models.vllm_shards`).

- Broadcast: each pipeline stage's export rank gathers its stage's tensors whole and broadcasts
  them bucket by bucket; every engine rank receives every tensor whole.
- Shard-to-shard: :func:`~bapo_megatron.resharding.plan.plan_reshard`; every engine rank receives
  its own shard, from the trainer ranks that hold it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.trainer_shards import ParamPlacement, TrainerRank, trainer_shard_map
from bapo_megatron.models.vllm_shards import vllm_shard_map
from bapo_megatron.planning.simulated_rank import (
    expert_coordinates,
    expert_rank,
    megatron_rank,
)
from bapo_megatron.resharding.plan import plan_reshard

_EXPERT = ".mlp.experts.local_experts."


@dataclass
class WeightTraffic:
    """Bytes and messages of one weight update, both paths."""

    engine_tp: int
    engine_replicas: int
    element_bytes: int
    broadcast_sent: dict[int, int] = field(default_factory=dict)
    """Trainer rank -> bytes it broadcasts (the stages' export ranks)."""
    broadcast_received: int = 0
    """Bytes every engine rank receives."""
    broadcast_messages: int = 0
    """Bucket broadcasts, all stages."""
    sent: dict[int, int] = field(default_factory=dict)
    """Shard-to-shard: trainer rank -> bytes it sends."""
    received: dict[int, int] = field(default_factory=dict)
    """Shard-to-shard: engine rank (numbered after the trainer's) -> bytes it receives."""
    messages: int = 0
    """Shard-to-shard: (sender, receiver, bucket) messages."""
    digest: str = ""

    def summary(self) -> dict[str, Any]:
        received = max(self.received.values(), default=0)
        return {
            "engine_tensor_parallel_size": self.engine_tp,
            "engine_replicas": self.engine_replicas,
            "broadcast": {
                "sent_bytes": {str(k): v for k, v in self.broadcast_sent.items()},
                "received_bytes_per_engine_rank": self.broadcast_received,
                "messages": self.broadcast_messages,
            },
            "shard_to_shard": {
                "sent_bytes": {str(k): v for k, v in self.sent.items()},
                "received_bytes": {str(k): v for k, v in self.received.items()},
                "messages": self.messages,
                "digest": self.digest,
            },
            "received_ratio": round(received / max(self.broadcast_received, 1), 4),
        }


def weight_traffic(
    model: ModelConfig,
    parallel: ParallelConfig,
    world_size: int,
    placements: Mapping[int, Sequence[ParamPlacement]],
    engine_tp: int,
    engine_replicas: int,
    bucket_bytes: int,
) -> WeightTraffic:
    """The traffic of ``world_size`` trainer ranks laid out as ``parallel`` (``placements``: of
    the simulated ranks, which hold every distinct shard) into ``engine_replicas`` vLLM replicas
    of ``engine_tp`` workers, at ``bucket_bytes`` per bucket."""
    element_bytes = torch.empty((), dtype=getattr(torch, model.params_dtype)).element_size()
    traffic = WeightTraffic(engine_tp, engine_replicas, element_bytes)
    rules = {rule.megatron: rule for rule in name_map_for(model.model_type).rules(model)}
    trainer, maps = [], {}  # data-parallel replicas hold the maps of their coordinates
    for rank in range(world_size):
        at = _coordinates(parallel, world_size, rank)
        dense = megatron_rank(parallel, world_size, at.tp_rank, 0, at.pp_rank)
        sparse = expert_rank(parallel, world_size, at.etp_rank, at.ep_rank, 0, at.pp_rank)
        if (dense, sparse) not in maps:
            held = [p for p in placements[dense] if _EXPERT not in p.name]
            held += [p for p in placements[sparse] if _EXPERT in p.name]
            maps[dense, sparse] = trainer_shard_map(model, held, rank, at, rules)
        trainer.append(dataclasses.replace(maps[dense, sparse], rank=rank))
    workers = [vllm_shard_map(model, r, engine_tp, world_size + r) for r in range(engine_tp)]
    engines = [
        [dataclasses.replace(m, rank=m.rank + i * engine_tp) for m in workers]
        for i in range(engine_replicas)
    ]
    plan = plan_reshard(trainer, engines, element_bytes, bucket_bytes)
    traffic.sent, traffic.received = plan.sent_bytes(), plan.received_bytes()
    traffic.messages, traffic.digest = plan.message_count, plan.digest

    shapes = name_map_for(model.model_type).hf_shapes(model)
    traffic.broadcast_received = sum(_numel(s) for s in shapes.values()) * element_bytes
    for stage in range(parallel.pipeline_model_parallel_size):
        export_rank = megatron_rank(parallel, world_size, 0, 0, stage)
        sent = _stage_elements(trainer, parallel, world_size, stage) * element_bytes
        traffic.broadcast_sent[export_rank] = sent
        traffic.broadcast_messages += -(-sent // bucket_bytes)
    return traffic


def _coordinates(parallel: ParallelConfig, world_size: int, rank: int) -> TrainerRank:
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    etp_rank, ep_rank, _ = expert_coordinates(parallel, world_size, rank)
    return TrainerRank(
        tp_rank=rank % tp,
        tp_size=tp,
        pp_rank=rank // (tp * dp),
        pp_size=pp,
        ep_rank=ep_rank,
        ep_size=parallel.expert_model_parallel_size,
        etp_rank=etp_rank,
        etp_size=parallel.expert_tensor_parallel_size,
        vpp_size=parallel.virtual_pipeline_model_parallel_size or 1,
    )


def _stage_elements(trainer, parallel: ParallelConfig, world_size: int, stage: int) -> int:
    """Distinct HF elements the ranks of pipeline stage ``stage`` hold."""
    boxes = {
        region.box: region.numel
        for shard_map in trainer
        if _coordinates(parallel, world_size, shard_map.rank).pp_rank == stage
        for region in shard_map.regions
    }
    return sum(boxes.values())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
