"""The receiver protocol: what an engine offers the shard-to-shard weight sync
(``rollout.weight_transport: shard-to-shard``): its workers' shard maps, and a way to receive a
plan's regions. Each engine's half lives in its adapter: :mod:`.vllm.shard_receiver`,
:mod:`.embedded.shard_receiver`, and for an engine on another process than the trainer rank
that drives it :mod:`bapo_megatron.disaggregated.remote_shard_receiver`.

Two kinds of receivers:

- workers of their own (vLLM in process or as a server): they join the trainer's transfer group
  as ranks after the trainer's and receive there, each into its own checkpoint-format
  parameters;
- the engine in the trainer rank's own process (the embedded engine, vLLM whose one worker runs
  in the process): that trainer rank receives, into the engine's parameters, in the same call
  that sends its own shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from bapo_megatron.models.shard_map import ShardMap
from bapo_megatron.resharding.execute import TargetTensors


@dataclass(frozen=True)
class ShardLayout:
    """An engine's receiving side, as the trainer plans it."""

    maps: tuple[ShardMap, ...]
    """One map per worker, ``rank`` its worker index (the trainer renumbers them)."""
    dtype: str
    """The dtype of the engine's weights (what elements travel as), e.g. ``"bfloat16"``."""
    in_process: bool
    """The engine receives in the trainer rank's process (else its workers join the group)."""
    instance: str = ""
    """Tells engines apart: a new engine (new workers to join the group) has a new one."""


class ShardReceiver(Protocol):
    """An engine that can receive shard to shard."""

    def shard_layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> ShardLayout:
        """Its workers' shard maps of the HF tensors ``hf_shapes`` (read once, then kept)."""

    def join_transfer_group(self, request: dict[str, Any]) -> None:
        """Workers of their own: join the group (SGLang's ``/init_weights_update_group``
        fields plus ``timeout_s``); returns once they have joined."""

    def receive_shards(self, request: dict[str, Any], *, version: int) -> list[dict[str, Any]]:
        """Workers of their own: receive one update (``group_name``, ``digest``,
        ``plan_follows``, ``wire_dtype``, ``timeout_s``, ``checksum``); returns each worker's
        report (``received_bytes``, ``checksum``) once every worker has loaded it."""

    def shard_targets(self, planned: set[str]) -> TargetTensors:
        """In process: the tensors the plan writes (``planned``: their names, its map's local
        names); the engine holds no whole weights until :meth:`shards_received`."""

    def shards_received(self, *, version: int, checksum: bool) -> str | None:
        """In process: every region has been written; the weights are policy ``version``.
        Returns the checksum of the engine's weights with ``checksum``."""
