"""The vLLM adapter's half of the shard-to-shard receiver protocol
(:class:`~bapo_megatron.rollout.shard_receiver_protocol.ShardReceiver`), for the engine in
process and the server client alike: on the client's side, what the workers are asked over
worker-extension calls. The workers join the trainer's transfer group and receive there
(:mod:`~bapo_megatron.rollout.vllm.worker_extension`, into
:mod:`~bapo_megatron.rollout.vllm.worker_shard_targets`); when the engine's one worker lives in
the trainer rank's process (vLLM's single-process executor), that rank writes it directly, as it
writes the embedded engine.

The worker maps are read off vLLM's own loaders once
(:mod:`~bapo_megatron.rollout.vllm.worker_shard_map`), before the first update that reloads
anything, and kept. A transfer that fails part-way leaves the engine refusing to generate until
an update lands whole (its workers may hold some layers of each version).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from bapo_megatron.models.shard_probe import mark_replicated
from bapo_megatron.rollout.shard_receiver_protocol import ShardLayout
from bapo_megatron.rollout.vllm.worker_extension import check_cpu_experts_reloadable, reloaded
from bapo_megatron.rollout.vllm.worker_shard_map import shard_map_from_probe
from bapo_megatron.rollout.vllm.worker_shard_targets import VllmShardTargets, weights_checksum


class VllmShardReceiving:
    """Mixed into :class:`~bapo_megatron.rollout.vllm.engine.VLLMEngine` and
    :class:`~bapo_megatron.rollout.vllm.server_client.VLLMServerClient`, which provide
    ``_worker_rpc(method, action, payload)``: one worker-extension call on every worker, its
    results in worker order."""

    _layout: ShardLayout | None = None
    _worker_in_process = False
    """The engine's one worker lives in this process (vLLM's single-process executor): the
    trainer rank receives into it, in the world group, as for the embedded engine."""
    _targets: VllmShardTargets | None = None

    def _worker_rpc(self, method: str, action: str, payload: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def shard_layout(self, hf_shapes: dict[str, tuple[int, ...]]) -> ShardLayout:
        if self._layout is None:
            request = {"hf_shapes": {name: list(shape) for name, shape in hf_shapes.items()}}
            reports = self._worker_rpc("bapo_probe_shard_map", "reading shard maps", request)
            reports = sorted(reports, key=lambda report: report["tp_rank"])
            unwritten = sorted({name for report in reports for name in report["unwritten"]})
            held = {region[0] for report in reports for region in report["regions"]}
            missing = [name for name in unwritten if name not in held]
            if missing:
                raise ValueError(
                    f"{self.engine_name}: no worker's loaders write {missing[:5]}: these "
                    "tensors cannot be sent shard to shard"
                )
            maps = [shard_map_from_probe(report, report["tp_rank"]) for report in reports]
            dtypes = {report["dtype"] for report in reports}
            if len(dtypes) != 1:
                raise ValueError(f"{self.engine_name}: workers of dtypes {sorted(dtypes)}")
            self._layout = ShardLayout(
                tuple(mark_replicated(maps, hf_shapes)),
                dtypes.pop(),
                in_process=self._worker_in_process,
                instance=uuid.uuid4().hex,
            )
        return self._layout

    def join_transfer_group(self, request: dict[str, Any]) -> None:
        self._worker_rpc("bapo_join_weight_group", "joining the transfer group", request)

    def receive_shards(self, request: dict[str, Any], *, version: int) -> list[dict[str, Any]]:
        if self._released:
            raise RuntimeError("update_weights after release_memory(): call resume_memory() first")
        self.version = -1  # until every worker has loaded the whole update
        reports = self._worker_rpc("bapo_receive_shards", "receiving shards", request)
        failed = [f"worker {i}: {r['error']}" for i, r in enumerate(reports) if r.get("error")]
        if failed:
            raise RuntimeError(f"{self.engine_name}: " + "; ".join(failed))
        self._after_shards()
        self.version = int(version)
        return list(reports)

    def _after_shards(self) -> None:
        """What follows an update (no KV computed under the old weights is reused)."""

    def shard_targets(self, planned: set[str]) -> VllmShardTargets:
        if not self._worker_in_process:
            raise TypeError(f"{self.engine_name}: workers receive in their own processes")
        if self._released:
            raise RuntimeError("update_weights after release_memory(): call resume_memory() first")
        model = self._worker_rpc("bapo_model", "taking the model", None)[0]
        check_cpu_experts_reloadable(model)
        self.version = -1  # until every region has been written
        self._targets = VllmShardTargets(model, planned)
        return self._targets

    def shards_received(self, *, version: int, checksum: bool) -> str | None:
        model, self._targets = self._targets.model, None
        reloaded(model)
        self._after_shards()
        self.version = int(version)
        return weights_checksum(model) if checksum else None

    def weights_checksums(self) -> list[str]:
        """Each worker's SHA-256 of its parameters, in worker order (equal for two engines of
        one layout exactly when their weights are)."""
        return list(self._worker_rpc("bapo_weights_checksum", "checksumming weights", None))


def rpc_payload(payload: dict[str, Any] | None) -> tuple[str, ...]:
    """The arguments of a worker-extension call: one JSON string, or none."""
    return () if payload is None else (json.dumps(payload),)
