"""A client of SGLang's HTTP server (``python -m sglang.launch_server``) as a rollout engine, for
disaggregated runs. Built like the in-process
:class:`~bapo_megatron.rollout.sglang.engine.SGLangEngine`
(a :class:`~bapo_megatron.rollout.resubmission.ResubmittingEngine` with the same request
bodies, answer parsing and weight buckets), over HTTP instead of ``sglang.Engine``'s methods.

Never run against a live SGLang server (SGLang has no CPU build): written against SGLang
0.5.x's HTTP routes and tested with a fake transport only. It needs no SGLang package on the
client side, except for weight updates, which serialize with SGLang's own serializer.

Routes used (JSON bodies as SGLang's ``io_struct`` request dataclasses define them):

==================================== =====================================================
``POST /generate``                   ``input_ids``, ``sampling_params``, ``return_logprob``,
                                     ``return_routed_experts`` (``record_routes``)
``POST /abort_request``              ``{"rid": "", "abort_all": true}``
``POST /pause_generation``           ``{"mode": "abort"}`` (older servers ignore the body)
``POST /continue_generation``        ``{}``
``POST /update_weights_from_tensor`` ``serialized_named_tensors`` (one per TP rank),
                                     ``load_format``, ``flush_cache``, ``weight_version``
``POST /begin_weight_update``, ``/end_weight_update`` (newer servers only)
``POST /init_weights_update_group``  ``master_address``, ``master_port``, ``rank_offset``,
                                     ``world_size``, ``group_name``, ``backend``
``POST /update_weights_from_distributed`` ``names``, ``dtypes``, ``shapes``, ``group_name``,
                                     ``flush_cache``, ``weight_version``
``POST /flush_cache``, ``/release_memory_occupation``, ``/resume_memory_occupation``
``GET /health``
==================================== =====================================================

Two weight routes (``weight_transport``). ``"same-host"``: ``update_weights_from_tensor`` in
buckets; SGLang's serializer passes CUDA tensors as IPC handles, so only metadata crosses HTTP
and the server must share the trainer's host. ``"process-group"``: the server's tensor-parallel
workers join a process group with this process (``/init_weights_update_group``, on the first
update and after a failed one; :mod:`bapo_megatron.rollout.weight_group`), and each update is
ONE ``/update_weights_from_distributed`` naming every tensor while this process broadcasts them:
SGLang receives everything a call names before it loads any of it, so one call per update leaves
the server on its previous weights when the broadcast is cut off part-way (several calls would
leave it with the first calls' tensors).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.http import (
    ApiKey,
    Transport,
    answers_health,
    call,
    http_transport,
)
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.resubmission import (
    EngineOutput,
    ResubmittingEngine,
    RoundRequest,
    wait_cutting,
)
from bapo_megatron.rollout.sglang.engine import (
    DEFAULT_BUCKET_BYTES,
    check_update_result,
    generate_request,
    load_in_buckets,
    parse_generate_response,
)
from bapo_megatron.rollout.weight_group import ServerWeightGroup

Serializer = Callable[[list[tuple[str, torch.Tensor]]], str]
"""Turns named tensors into the string SGLang's ``update_weights_from_tensor`` route expects."""


def sglang_serializer(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` (needs sglang)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as error:
        raise ImportError(
            "update_weights_from_tensor over HTTP serializes with SGLang's own "
            "serializer: install sglang on the client too"
        ) from error
    return MultiprocessingSerializer.serialize(named_tensors, output_str=True)


def tensor_update_request(
    payload: str, *, tp_size: int, flush_cache: bool, weight_version: str | None = None
) -> dict[str, Any]:
    """Body of ``/update_weights_from_tensor``: the serialized tensors once per TP rank."""
    return {
        "serialized_named_tensors": [payload] * tp_size,
        "load_format": None,
        "flush_cache": flush_cache,
        "weight_version": weight_version,
    }


class SGLangServerClient(ResubmittingEngine):
    """A :class:`~bapo_megatron.rollout.protocol.RolloutEngine` on one SGLang server.

    ``transport`` defaults to :func:`~bapo_megatron.rollout.http.http_transport` on ``base_url``
    (giving up after ``timeout`` seconds); ``tp_size`` is the server's tensor-parallel size (one
    tensor payload per rank, or one group member per rank); ``serialize`` defaults to
    :func:`sglang_serializer`. ``version``, ``bucket_bytes`` and ``weight_update_session`` are
    as for :class:`~bapo_megatron.rollout.sglang.engine.SGLangEngine` (the same-host route).
    ``weight_transport`` picks the weight route (module docstring); ``timeout`` also bounds
    joining the process group and each of its broadcasts. ``record_routes``: ask for each
    token's experts (a server started with ``--enable-return-routed-experts``) and fill each
    sample's ``routes``.
    """

    engine_name = "SGLang"
    routes_option = "--enable-return-routed-experts"

    def __init__(
        self,
        base_url: str,
        model: ModelConfig,
        *,
        version: int = -1,
        transport: Transport | None = None,
        tp_size: int = 1,
        serialize: Serializer | None = None,
        timeout: float = 3600.0,
        api_key: ApiKey | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_update_session: bool = False,
        weight_transport: str = "same-host",
        record_routes: bool = False,
    ) -> None:
        super().__init__(model, version=version, record_routes=record_routes)
        if weight_transport not in ("same-host", "process-group"):
            raise ValueError(
                f"weight_transport must be 'same-host' or 'process-group', got {weight_transport!r}"
            )
        self.base_url = base_url
        self.transport = transport or http_transport(
            base_url, timeout=timeout, server="SGLang server", api_key=api_key
        )
        self.tp_size = tp_size
        self.serialize = serialize or sglang_serializer
        self.bucket_bytes = bucket_bytes
        self.weight_update_session = weight_update_session
        self.weight_group: ServerWeightGroup | None = None
        """The process-group route's group (``weight_transport="process-group"``)."""
        if weight_transport == "process-group":
            self.weight_group = ServerWeightGroup(
                server=f"SGLang at {base_url}",
                base_url=base_url,
                server_ranks=tp_size,
                join=self._join_group,
                receive=self._receive_update,
                timeout=datetime.timedelta(seconds=timeout),
            )

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return call(
            self.transport,
            "POST",
            path,
            body if body is not None else {},
            server=f"SGLang at {self.base_url}",
        )

    # -------------------------------------------------------------- generation and control

    def _submit(self, requests: list[RoundRequest], params: SamplingParams) -> list[EngineOutput]:
        # The call runs on a helper thread so that this one can keep aborting while a pause or
        # abort is pending: a /generate that reaches SGLang just after pause_generation would
        # otherwise wait for continue_generation.
        body = generate_request(requests, params, routes=self.record_routes)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-generate") as pool:
            [response] = wait_cutting(
                [pool.submit(self._post, "/generate", body)], self._cut, self._on_abort
            )
        return parse_generate_response(
            response, len(requests), routes=self.model_config if self.record_routes else None
        )

    def _on_abort(self) -> None:
        self._post("/abort_request", {"rid": "", "abort_all": True})

    def _on_pause(self) -> None:
        self._post("/pause_generation", {"mode": "abort"})

    def _on_resume(self) -> None:
        self._post("/continue_generation", {})

    # -------------------------------------------------------------- weights and memory

    def _load_weights(
        self, tensors: Iterator[tuple[str, torch.Tensor]], *, version: int, checksum: bool
    ) -> None:
        """Same host: ``/update_weights_from_tensor`` in buckets (checked while they stream).
        Process group: every tensor checked, then one ``/update_weights_from_distributed``.
        Then one ``/flush_cache`` (which SGLang refuses with 400 while requests run)."""
        if self.weight_group is not None:
            received = list(tensors)  # every check passes before anything is sent
            if received:
                self.weight_group.update(received, weight_version=str(version))
            self._post("/flush_cache")
            return
        session = None
        if self.weight_update_session:
            session = (
                lambda: check_update_result(
                    self._post("/begin_weight_update", {"selector": "all"}), "begin_weight_update"
                ),
                lambda: check_update_result(
                    self._post("/end_weight_update", {}), "end_weight_update"
                ),
            )
        load_in_buckets(tensors, self.bucket_bytes, self._send_bucket, session=session)
        self._post("/flush_cache")

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        body = tensor_update_request(
            self.serialize(bucket), tp_size=self.tp_size, flush_cache=False
        )
        check_update_result(
            self._post("/update_weights_from_tensor", body), "update_weights_from_tensor"
        )

    def _join_group(self, request: dict[str, Any]) -> None:
        check_update_result(
            self._post("/init_weights_update_group", request), "init_weights_update_group"
        )

    def _receive_update(self, request: dict[str, Any]) -> None:
        # the cache is flushed once, after the call (see _load_weights)
        check_update_result(
            self._post("/update_weights_from_distributed", {**request, "flush_cache": False}),
            "update_weights_from_distributed",
        )

    def _release(self) -> None:
        """``/release_memory_occupation``: frees weights and KV cache."""
        self._post("/release_memory_occupation", {})

    def _resume(self) -> None:
        """``/resume_memory_occupation``."""
        self._post("/resume_memory_occupation", {})

    def _alive(self) -> bool:
        return answers_health(self.transport)
