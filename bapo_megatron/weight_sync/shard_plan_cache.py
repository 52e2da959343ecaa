"""What the shard-to-shard sync keeps on one trainer rank between updates (:class:`ShardSync`):
the shard maps and the plan of the current layouts, and the transfer group
(:mod:`.transfer_group`).

The maps are derived once per layout: this rank's map is read off the actor's model chunks the
first time the actor is pushed (:func:`trainer_map`: the name map's rules applied to each local
parameter), and every engine reads its workers' maps once and keeps them
(:class:`~bapo_megatron.rollout.shard_receiver_protocol.ShardReceiver`). Each update then costs
one small all-gather of a digest per rank (:func:`plan_if_changed`); only when a rank's map, an
engine's layout or the bucket size changed are the maps gathered and the plan made again
(:func:`~bapo_megatron.resharding.plan.plan_reshard`), the same on every rank.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import Actor
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.shard_map import ShardMap
from bapo_megatron.models.trainer_shards import TrainerRank, chunk_placements, trainer_shard_map
from bapo_megatron.resharding.execute import TransferCounts
from bapo_megatron.resharding.plan import ReshardPlan, plan_reshard
from bapo_megatron.rollout.shard_receiver_protocol import ShardLayout, ShardReceiver
from bapo_megatron.rollout.weight_group import leave_weight_group


@dataclass
class ShardSync:
    """What the shard-to-shard sync keeps between updates on one trainer rank."""

    timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    """Bounds joining the group and each wait of a transfer (a training run passes
    ``parallel.collective_timeout_s``)."""
    plan: ReshardPlan | None = None
    key: str = ""
    """This rank's map, its engine's layout and the bucket size the plan was made for."""
    layouts: list[ShardLayout | None] = field(default_factory=list)
    """Per trainer rank, the layout of the engine it holds (None: no engine)."""
    group: dist.ProcessGroup | None = None
    """The transfer group (trainer ranks, then engine workers); None: the world group."""
    group_name: str = ""
    workers_hold: str | None = None
    """Digest of the plan the engine workers hold."""
    last: TransferCounts | None = None
    """What this rank moved in the last update."""
    sent_bytes: int = 0
    """Bytes this rank has sent to other processes over every update so far."""
    _store: Any = None
    _source: Any = field(default=None, repr=False)
    """The actor :attr:`_own` was read off (a new actor is a new layout)."""
    _own: tuple[ShardMap, dict[str, tuple[int, ...]]] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.group is not None:
            leave_weight_group(self.group)
        self.group = self._store = None

    def own_map(self, actor: Actor) -> tuple[ShardMap, dict[str, tuple[int, ...]]]:
        """This rank's shard map and the model's HF tensor shapes, read off ``actor`` once."""
        if self._own is None or self._source is not actor:
            hf_shapes = name_map_for(actor.model_config.model_type).hf_shapes(actor.model_config)
            self._own, self._source = (trainer_map(actor), hf_shapes), actor
        return self._own

    @property
    def wire_dtype(self) -> str:
        """The engines' dtype, in which elements travel (``ValueError`` when they differ)."""
        dtypes = {layout.dtype for layout in self.layouts if layout is not None}
        if len(dtypes) != 1:
            raise ValueError(f"shard-to-shard weight sync: engines of dtypes {sorted(dtypes)}")
        return next(iter(dtypes))


def trainer_map(actor: Actor) -> ShardMap:
    """This rank's shard map, read off its model chunks (no collective)."""
    ctx = actor.context
    at = TrainerRank(
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
        pp_rank=ctx.pp_rank,
        pp_size=ctx.pp_size,
        ep_rank=ctx.ep_rank,
        ep_size=ctx.ep_size,
        etp_rank=ctx.etp_rank,
        etp_size=ctx.etp_size,
        vpp_size=ctx.vpp_size or 1,
    )
    return trainer_shard_map(actor.model_config, chunk_placements(actor.chunks), ctx.rank, at)


def plan_if_changed(
    actor: Actor, engine: ShardReceiver | None, sync: ShardSync, bucket_bytes: int
) -> None:
    """Plan again when any rank's map, engine layout or bucket size changed since the plan was
    made (one small all-gather of each rank's key, then, if so, one of the maps): every rank
    ends with the same plan."""
    context = actor.context
    own, hf_shapes = sync.own_map(actor)
    mine = (own, None if engine is None else engine.shard_layout(hf_shapes))
    key = hashlib.sha256(pickle.dumps((mine, bucket_bytes))).hexdigest()
    keys: list[Any] = [None] * context.world_size
    dist.all_gather_object(keys, key == sync.key)
    if all(keys) and sync.plan is not None:
        return
    sync.plan, sync.key, sync.workers_hold = None, "", None
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, mine)
    trainer = [shard_map for shard_map, _ in gathered]
    if [layout for _, layout in gathered] != sync.layouts:
        sync.close()  # the group's members change with the engines
    sync.layouts = [layout for _, layout in gathered]
    engines: list[list[ShardMap]] = []
    next_rank = context.world_size
    for rank, layout in enumerate(sync.layouts):
        if layout is None:
            continue
        if layout.in_process:
            if len(layout.maps) != 1:
                raise ValueError(f"rank {rank}: an in-process engine has one map")
            engines.append([_renumbered(layout.maps[0], rank)])
        else:
            engines.append([_renumbered(m, next_rank + m.rank) for m in layout.maps])
            next_rank += len(layout.maps)
    if not engines:
        raise ValueError("shard-to-shard weight sync: no rank holds an engine")
    element = torch.empty((), dtype=getattr(torch, sync.wire_dtype)).element_size()
    sync.plan = plan_reshard(trainer, engines, element, max(bucket_bytes, element))
    sync.key = key


def _renumbered(shard_map: ShardMap, rank: int) -> ShardMap:
    return ShardMap(rank, shard_map.regions, shard_map.fills, shard_map.local_shapes)
