"""SGLang: the in-process engine (``sglang.Engine``) and the HTTP server client.

The family's builders for :mod:`bapo_megatron.rollout.registry` live here. The adapters import
sglang only when an engine starts, so registering the family does not need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bapo_megatron.rollout.http import check_server_answers, rollout_api_key
from bapo_megatron.rollout.sglang.engine import SGLangEngine
from bapo_megatron.rollout.sglang.server_client import SGLangServerClient

if TYPE_CHECKING:
    from bapo_megatron.rollout.engine_setup import EngineSetup
    from bapo_megatron.rollout.protocol import RolloutEngine

FAMILY = "sglang"
"""Its ``rollout.engine`` kinds: ``sglang`` (in process) and ``sglang-server``."""


def start_in_process(setup: EngineSetup) -> RolloutEngine:
    """``sglang.Engine`` in this process on the run's HF folder, sized by the rollout settings.
    On a GPU rank its workers start at the rank's own GPU (``base_gpu_id``): SGLang would
    otherwise take GPUs 0.. of the node, so two replicas sharing a node would both land there."""

    rollout = setup.rollout
    on_gpu = setup.device.startswith("cuda")  # the trainer passes its rank's, e.g. "cuda:0"
    placement = {"base_gpu_id": torch.cuda.current_device()} if on_gpu else {}
    return SGLangEngine.in_process(
        setup.hf_folder(),
        dtype=setup.engine_dtype,
        tp_size=rollout.engine_tensor_parallel_size,
        mem_fraction_static=rollout.gpu_memory_utilization,
        bucket_bytes=rollout.weight_bucket_mib * 2**20,
        record_routes=setup.record_routes,
        **placement,
        **setup.quantization_options(),
        **({"load_format": "dummy"} if setup.starts_without_weights else {}),
    )


def connect_server(setup: EngineSetup) -> RolloutEngine:
    """A client of the replica's SGLang server (no weights yet: version -1; refused within a
    bounded time when the URL does not answer), sending weights by
    ``rollout.weight_transport``."""

    rollout = setup.rollout
    api_key = rollout_api_key(setup.rollout)
    check_server_answers(setup.url, server="SGLang server", api_key=api_key)
    return SGLangServerClient(
        setup.url,
        setup.model,
        tp_size=rollout.engine_tensor_parallel_size,
        timeout=setup.http_timeout,
        api_key=api_key,
        bucket_bytes=rollout.weight_bucket_mib * 2**20,
        weight_transport=rollout.weight_transport,
        record_routes=setup.record_routes,
    )
