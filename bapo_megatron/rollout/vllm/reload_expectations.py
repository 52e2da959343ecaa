"""Tell vLLM 0.32's in-place reload which tensors no checkpoint holds, so that it neither waits
for them nor warns that they "failed to load".

``reload_weights(is_checkpoint_format=True)`` (``model_executor/model_loader/reload/``) counts,
for every module, the elements its weight loaders must receive before the module is
processed; a module that received none although it counts some is put back as it was with
``WARNING [layerwise.py:266] <Module>: Failed to load weights``. Two kinds of module count
tensors that are never sent, so every update of every model warned:

- the tied output layer (``ParallelLMHead`` of a model with ``tie_word_embeddings``): its
  ``weight`` is the embedding's, which the update fills through ``embed_tokens``; a tied
  checkpoint (and this project's export) has no ``lm_head.weight``;
- modules whose only tensors are non-persistent buffers (``RotaryEmbedding``'s
  ``cos_sin_cache``): a state dict, hence a checkpoint, never holds them.

The count is vLLM's own ``weight_loader_numel`` (how its fused-MoE layers leave their padding
out); it is read off the meta copies the reload restores each module from
(``get_layerwise_info(module).restore_metadata``), so setting it to 0 there makes such a module
count nothing: the reload then puts it back silently, as it did with the warning. A module that
is sent its tensors anyway is still loaded (a count of 0 is reached by the first load).
"""

from __future__ import annotations

from typing import Any

import torch


def never_loaded(model: Any) -> dict[str, list[str]]:
    """The tensors of ``model`` (a vLLM model) that no checkpoint-format update carries, by the
    qualified name of their module: the tied output layer's ``weight``, and the buffers of
    modules that have no parameters and only non-persistent buffers."""
    found: dict[str, list[str]] = {}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, module in model.named_modules():
        if tied and name == "lm_head" and module._parameters.get("weight") is not None:
            found[name] = ["weight"]
            continue
        buffers = [b for b, tensor in module._buffers.items() if tensor is not None]
        has_parameters = any(p is not None for p in module._parameters.values())
        if buffers and not has_parameters:
            if all(b in module._non_persistent_buffers_set for b in buffers):
                found[name] = buffers
    return found


def expect_no_checkpoint_tensors(model: Any) -> int:
    """Make vLLM's layerwise reload count the :func:`never_loaded` tensors of ``model`` as 0
    elements (idempotent; call before every reload). Returns how many tensors it marked."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    marked = 0
    for name, tensors in never_loaded(model).items():
        parameters, buffers = get_layerwise_info(model.get_submodule(name)).restore_metadata
        for tensor_name in tensors:
            restored = parameters.get(tensor_name, buffers.get(tensor_name))
            if isinstance(restored, torch.Tensor):
                restored.weight_loader_numel = 0
                marked += 1
    return marked
