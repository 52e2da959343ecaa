"""The embedded adapter's half of the shard-to-shard receiver protocol
(:class:`~bapo_megatron.rollout.shard_receiver_protocol.ShardReceiver`): the engine lives in a
trainer rank's process, so that rank receives each region straight into the engine's parameters
(no tensor is assembled first), in the same transfer that sends the rank's own shards.

The engine holds every HF tensor whole, in its parameter of the same name or in a view of a
fused parameter (transformers' fused experts); its map is read off those views.
"""

from __future__ import annotations

import torch

from bapo_megatron.models.experts import fused_expert_view
from bapo_megatron.models.shard_map import Region, ShardMap
from bapo_megatron.resharding.execute import ResidentTargets
from bapo_megatron.rollout.checksum import Checksum
from bapo_megatron.rollout.shard_receiver_protocol import ShardLayout


class EmbeddedShardReceiving:
    """Mixed into :class:`~bapo_megatron.rollout.embedded.engine.EmbeddedEngine`, which
    provides ``model``, ``version`` and ``_released``."""

    model: torch.nn.Module
    version: int
    _released: bool

    def shard_layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> ShardLayout:
        """Its map (:func:`whole_tensor_map`): the trainer rank that holds it receives."""
        params = dict(self.model.named_parameters())
        dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
        return ShardLayout((whole_tensor_map(params, hf_shapes),), dtype, in_process=True)

    def shard_targets(self, planned: set[str]) -> ResidentTargets:
        if self._released:
            raise RuntimeError("update_weights after release_memory(): call resume_memory() first")
        self.version = -1  # until every region has been written
        return ResidentTargets({n: p.data for n, p in self.model.named_parameters()})

    def shards_received(self, *, version: int, checksum: bool) -> str | None:
        self.version = int(version)
        if not checksum:
            return None
        total = Checksum()
        for name, param in sorted(self.model.named_parameters()):
            total.add(name, param.data)
        return total.hexdigest()


def whole_tensor_map(
    params: dict[str, torch.nn.Parameter], hf_shapes: dict[str, tuple[int, ...]], rank: int = 0
) -> ShardMap:
    """The map of a model that holds each tensor of ``hf_shapes`` whole in ``params`` (by name,
    or as a view of a fused parameter); a tied ``lm_head.weight`` it does not have is skipped.
    ``ValueError`` naming a tensor it cannot place."""
    by_storage = {
        param.untyped_storage().data_ptr(): (name, param) for name, param in params.items()
    }
    regions = []
    used: dict[str, tuple[int, ...]] = {}
    for hf, shape in hf_shapes.items():
        view = fused_expert_view(hf, params)
        if view is None:
            view = params.get(hf)
        if view is None:
            if hf == "lm_head.weight":
                continue
            raise ValueError(f"the engine has no parameter for {hf!r}")
        if tuple(view.shape) != tuple(shape):
            raise ValueError(f"{hf!r}: the engine holds shape {tuple(view.shape)}, not {shape}")
        name, base = by_storage[view.untyped_storage().data_ptr()]
        if not base.is_contiguous() or (view.dim() == 2 and view.stride(1) != 1):
            raise ValueError(f"{hf!r}: {name} is not laid out in rows")
        offset = view.storage_offset() - base.storage_offset()
        rows = shape[0]
        cols = shape[1] if len(shape) == 2 else 1
        stride = view.stride(0) if len(shape) == 2 else 1
        regions.append(Region(hf, 0, 0, rows, cols, name, offset, stride))
        used[name] = tuple(base.shape)
    return ShardMap(rank, tuple(regions), (), tuple(sorted(used.items())))
