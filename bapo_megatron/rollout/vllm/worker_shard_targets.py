"""A vLLM worker's side of a shard-to-shard transfer (written for vLLM 0.32): the
:class:`~bapo_megatron.resharding.execute.TargetTensors` the executor writes, layer by layer in
the checkpoint format that vLLM's loaders fill.

A layer is taken apart when the plan first writes one of its parameters, as vLLM's in-place
reload does it (its processed "kernel" tensors set aside, the parameters restored to their
checkpoint shapes and allocated), and put together once every parameter of it that the plan
writes is complete: the quantization method's post-load processing runs and the processed
values are copied into the kernel tensors, which go back in place (CUDA graphs keep pointing at
them). So a worker holds at most the layers of one bucket twice. A bias, which vLLM never
restores, is written in place.

A layer whose post-load processing keeps its checkpoint-format parameters where they are (its
live parameters have the recorded shapes and dtypes, and it has no quantization method, or
vLLM's unquantized linear or embedding method) is written in place instead
(:func:`writes_in_place`), then processed again: no copy of its parameters is made. On CUDA
that processing does nothing; on CPU the embedding and output layers get a new packed copy for
the GEMM, while linear layers, whose packing drops the weight, are taken apart.

After a failed transfer :meth:`VllmShardTargets.abort` puts the set-aside tensors of the layers
still open back; layers completed before the failure hold the new weights, so the engine refuses
to generate until a whole update lands (its version stays -1: the receiving side of the engine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

IN_PLACE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""vLLM 0.32's quantization methods whose ``process_weights_after_loading`` derives what it needs
from the weight without changing it, when it keeps the weight: nothing on CUDA; on CPU a packed
copy for the GEMM, beside the weight (embedding, output layer) or in its place (linear: the
weight left empty, so the shape check refuses it)."""


def writes_in_place(
    module: torch.nn.Module, recorded: dict[str, Any], written: Iterable[str]
) -> bool:
    """Whether ``module``'s parameters ``written`` can be written where they live and the module
    then processed again: each has the shape and dtype vLLM recorded for its checkpoint format
    (``recorded``; a parameter it did not record is one it never restores) and is contiguous,
    and the module has no quantization method or one of :data:`IN_PLACE_METHODS`."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for name in written:
        live = module._parameters.get(name)
        if live is None or not live.is_contiguous():
            return False
        meta = recorded.get(name)
        if meta is not None and (tuple(meta.shape), meta.dtype) != (tuple(live.shape), live.dtype):
            return False
    method = getattr(module, "quant_method", None)
    return not isinstance(method, QuantizeMethodBase) or type(method).__name__ in IN_PLACE_METHODS


class VllmShardTargets:
    """The checkpoint-format parameters of ``model`` (a worker's model) that ``planned`` (the
    plan's target names for this worker, ``module.parameter``) writes, in ``dtype``."""

    def __init__(self, model: torch.nn.Module, planned: Iterable[str]) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        self.model, self.info_of = model, LAYERWISE_INFO
        self.in_place: set[str] = set()
        """Modules written where they live (:func:`writes_in_place`), decided when opened."""
        self.modules = dict(model.named_modules())
        self.pending: dict[str, set[str]] = {}
        for name in planned:
            module, _, param = name.rpartition(".")
            self.pending.setdefault(module, set()).add(param)
        self.open_modules: dict[str, set[str]] = {}
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")

    def numel(self, name: str) -> int | None:
        module_name, _, param = name.rpartition(".")
        module = self.modules.get(module_name)
        if module is None:
            return None
        recorded = self._recorded(module)
        template = recorded.get(param, module._parameters.get(param))
        if template is None:
            return None
        written = self.pending.get(module_name, set())
        missing = sorted(set(recorded) - written)
        if missing and not writes_in_place(module, recorded, written):
            raise ValueError(
                f"{module_name}: the plan writes {sorted(self.pending.get(module_name, ()))} "
                f"but not {missing}, which vLLM restores before processing the layer"
            )
        return template.numel()

    def open(self, name: str) -> torch.Tensor:
        module_name, _, param = name.rpartition(".")
        if module_name not in self.open_modules:
            module, written = self.modules[module_name], self.pending[module_name]
            if writes_in_place(module, self._recorded(module), written):
                self.in_place.add(module_name)
                self.open_modules[module_name] = set(written)
            else:
                self._take_apart(module_name)
        return getattr(self.modules[module_name], param).data

    def written(self, names: list[str]) -> None:
        for name in names:
            module_name, _, param = name.rpartition(".")
            remaining = self.open_modules[module_name]
            remaining.discard(param)
            if not remaining and module_name in self.in_place:
                process_again(self.modules[module_name])
                del self.open_modules[module_name]
            elif not remaining:
                self._put_together(module_name)

    def abort(self) -> None:
        """Put back the set-aside tensors of every layer still open (they keep their previous
        weights; one written in place holds part of the new ones)."""
        from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors

        for module_name in list(self.open_modules):
            if module_name in self.in_place:
                del self.open_modules[module_name]
                continue
            module = self.modules[module_name]
            info = self.info_of[module]
            if info.kernel_tensors is not None:
                _place_kernel_tensors(module, info)
            info.reset()
            del self.open_modules[module_name]

    def _recorded(self, module: torch.nn.Module) -> dict[str, Any]:
        info = self.info_of.get(module)
        return info.restore_metadata[0] if info is not None else {}

    def _take_apart(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import (
            materialize_layer,
            restore_layer_on_meta,
        )
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        module = self.modules[module_name]
        info = get_layerwise_info(module)
        info.kernel_tensors = get_layer_params_buffers(module)
        info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
        restore_layer_on_meta(module, info)
        materialize_layer(module, info)
        self.open_modules[module_name] = set(self.pending[module_name])

    def _put_together(self, module_name: str) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            _copy_and_restore_kernel_tensors,
        )

        module = self.modules[module_name]
        info = self.info_of[module]
        process_again(module)
        _copy_and_restore_kernel_tensors(module, info)
        info.reset()
        del self.open_modules[module_name]


def process_again(module: torch.nn.Module) -> None:
    """Run the module's post-load processing (its quantization method's) on what was written."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    method = getattr(module, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        method.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()


def weights_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of a worker's parameters (names in order, dtypes, shapes, bytes): equal on two
    workers of the same rank exactly when their weights are."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        tensor = param.detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
