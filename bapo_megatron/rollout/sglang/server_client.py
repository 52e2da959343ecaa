"""A client of SGLang's HTTP server (``python -m sglang.launch_server``), for disaggregated runs:
the :class:`~bapo_megatron.rollout.sglang.engine.SGLangBackend` that
:class:`~bapo_megatron.rollout.sglang.engine.SGLangEngine` drives, plus the weight-update routes
a trainer on other machines needs.

NOT RUN HERE (SGLang cannot run on these CPU machines): written against SGLang 0.5.x's HTTP
routes and tested with a fake transport only. It needs no SGLang package on the client side,
except :meth:`SGLangHTTPClient.update_weights_from_tensor`, which serializes with SGLang's own
serializer.

Routes used (JSON bodies as SGLang's ``io_struct`` request dataclasses define them):

==================================== =====================================================
``POST /generate``                   ``input_ids``, ``sampling_params``, ``return_logprob``
``POST /abort_request``              ``{"rid": "", "abort_all": true}``
``POST /pause_generation``           ``{"mode": "abort"}`` (older servers ignore the body)
``POST /continue_generation``        ``{}``
``POST /update_weights_from_tensor`` ``serialized_named_tensors`` (one per TP rank),
                                     ``load_format``, ``flush_cache``, ``weight_version``
``POST /update_weights_from_disk``   ``model_path``, ``load_format``, ``weight_version``
``POST /init_weights_update_group``  ``master_address``, ``master_port``, ``rank_offset``,
                                     ``world_size``, ``group_name``, ``backend``
``POST /update_weights_from_distributed`` ``names``, ``dtypes``, ``shapes``, ``group_name``,
                                     ``flush_cache``, ``weight_version``
``POST /destroy_weights_update_group`` ``group_name``
``POST /begin_weight_update``, ``/end_weight_update`` (newer servers only)
``POST /flush_cache``, ``/release_memory_occupation``, ``/resume_memory_occupation``
``GET /health``
==================================== =====================================================

Which weight path fits which deployment:

- Same host (colocated server): ``update_weights_from_tensor``; SGLang's serializer passes CUDA
  tensors as IPC handles, so only metadata crosses HTTP.
- Shared filesystem: write an HF folder (``bapo_megatron.weights``), then
  :meth:`~SGLangHTTPClient.update_weights_from_disk`.
- Across machines with GPUs: :meth:`~SGLangHTTPClient.init_weights_update_group` once, then per
  update :meth:`~SGLangHTTPClient.update_weights_from_distributed` while the trainer broadcasts
  the same tensors, in the same order, from rank 0 of that NCCL group (the HTTP call returns
  when the server has received them, so send it from another thread than the broadcast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bapo_megatron.config import ModelConfig
from bapo_megatron.rollout.resubmission import Transport, call, http_transport
from bapo_megatron.rollout.sglang.engine import SGLangEngine, check_update_result

Serializer = Callable[[list[tuple[str, torch.Tensor]]], str]
"""Turns named tensors into the string SGLang's ``update_weights_from_tensor`` route expects."""


def sglang_serializer(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` (needs sglang)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as error:
        raise ImportError("update_weights_from_tensor over HTTP serializes with SGLang's own "
                          "serializer: install sglang on the client too, or update from disk "
                          "or over NCCL") from error
    return MultiprocessingSerializer.serialize(named_tensors, output_str=True)


def tensor_update_request(payload: str, *, tp_size: int, flush_cache: bool,
                          weight_version: str | None = None) -> dict[str, Any]:
    """Body of ``/update_weights_from_tensor``: the serialized tensors once per TP rank."""
    return {"serialized_named_tensors": [payload] * tp_size, "load_format": None,
            "flush_cache": flush_cache, "weight_version": weight_version}


def disk_update_request(model_path: str, *, weight_version: str | None = None,
                        load_format: str | None = None) -> dict[str, Any]:
    """Body of ``/update_weights_from_disk``."""
    return {"model_path": model_path, "load_format": load_format,
            "weight_version": weight_version}


def distributed_update_request(named_tensors: list[tuple[str, torch.Tensor]], *,
                               group_name: str, flush_cache: bool = True,
                               weight_version: str | None = None) -> dict[str, Any]:
    """Body of ``/update_weights_from_distributed``: names, dtypes (``"bfloat16"``...) and
    shapes of the tensors the trainer broadcasts next, in broadcast order."""
    return {"names": [name for name, _ in named_tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
            "shapes": [list(t.shape) for _, t in named_tensors],
            "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version}


class SGLangHTTPClient:
    """The :class:`~bapo_megatron.rollout.sglang.engine.SGLangBackend` of one SGLang server.

    ``transport`` defaults to :func:`~bapo_megatron.rollout.resubmission.http_transport` on
    ``base_url``; ``tp_size`` is the server's tensor-parallel size (one tensor payload per rank);
    ``serialize`` defaults to :func:`sglang_serializer`.
    """

    def __init__(self, base_url: str, *, transport: Transport | None = None, tp_size: int = 1,
                 serialize: Serializer | None = None, timeout: float = 3600.0) -> None:
        self.base_url = base_url
        self.transport = transport or http_transport(base_url, timeout=timeout, server="SGLang server")
        self.tp_size = tp_size
        self.serialize = serialize or sglang_serializer

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return call(self.transport, "POST", path, body if body is not None else {},
                    server=f"SGLang at {self.base_url}")

    # -------------------------------------------------------------- the backend

    def generate(self, request: dict[str, Any]) -> Any:
        return self._post("/generate", request)

    def abort_all(self) -> None:
        self._post("/abort_request", {"rid": "", "abort_all": True})

    def pause(self) -> None:
        self._post("/pause_generation", {"mode": "abort"})

    def resume(self) -> None:
        self._post("/continue_generation", {})

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], *,
                                   flush_cache: bool, weight_version: str | None = None) -> None:
        body = tensor_update_request(self.serialize(named_tensors), tp_size=self.tp_size,
                                     flush_cache=flush_cache, weight_version=weight_version)
        check_update_result(self._post("/update_weights_from_tensor", body),
                            "update_weights_from_tensor")

    def begin_weight_update(self) -> None:
        check_update_result(self._post("/begin_weight_update", {"selector": "all"}),
                            "begin_weight_update")

    def end_weight_update(self) -> None:
        check_update_result(self._post("/end_weight_update", {}), "end_weight_update")

    def flush_cache(self) -> None:
        self._post("/flush_cache")  # 400 while requests run: call() raises

    def release_memory(self) -> None:
        self._post("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self._post("/resume_memory_occupation", {})

    def health(self) -> bool:
        try:
            status, _ = self.transport("GET", "/health", None)
        except OSError:
            return False
        return status == 200

    # -------------------------------------------------------------- other weight paths

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                 load_format: str | None = None) -> None:
        """Load the HF folder ``model_path`` (as the server sees it) in place."""
        body = disk_update_request(model_path, weight_version=weight_version,
                                   load_format=load_format)
        check_update_result(self._post("/update_weights_from_disk", body), "update_weights_from_disk")

    def init_weights_update_group(self, *, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str = "nccl") -> None:
        """Have the server's ranks join an NCCL group with the trainer's broadcasting rank
        (ranks ``rank_offset ...`` of ``world_size``; the trainer is rank 0)."""
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
                "backend": backend}
        check_update_result(self._post("/init_weights_update_group", body),
                            "init_weights_update_group")

    def update_weights_from_distributed(self, named_tensors: list[tuple[str, torch.Tensor]], *,
                                        group_name: str = "weight_update_group",
                                        flush_cache: bool = True,
                                        weight_version: str | None = None) -> None:
        """Announce the tensors the trainer broadcasts next over ``group_name``; returns once the
        server has received them."""
        body = distributed_update_request(named_tensors, group_name=group_name,
                                          flush_cache=flush_cache, weight_version=weight_version)
        check_update_result(self._post("/update_weights_from_distributed", body),
                            "update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        check_update_result(self._post("/destroy_weights_update_group", {"group_name": group_name}),
                            "destroy_weights_update_group")


def connect(base_url: str, model: ModelConfig, *, version: int = 0, **client_kwargs: Any
            ) -> SGLangEngine:
    """An :class:`SGLangEngine` on the server at ``base_url``, whose weights are policy
    ``version`` (the folder it was started from is usually version 0)."""
    return SGLangEngine(SGLangHTTPClient(base_url, **client_kwargs), model, version=version)
