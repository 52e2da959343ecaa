"""The experts an external engine (vLLM, SGLang) routed each token to, decoded into
:attr:`~bapo_megatron.rollout.protocol.RolloutSample.routes` (the layout the embedded engine
records and the actor replays, :mod:`bapo_megatron.actor.routing_replay`).

What the engines return, per request that finished (read from their sources):

- vLLM 0.32 (``enable_return_routed_experts``): in process, ``CompletionOutput.routed_experts``,
  a numpy array; from its server, ``choices[i].routed_experts``, the base64 of that array's
  ``.npy`` file. Shape ``[tokens, num_hidden_layers, top_k]``, uint8 (uint16 past 256 experts):
  the layer axis counts EVERY decoder layer (the capture is indexed by the layer number), and
  the columns of dense layers (``mlp_only_layers``, ``decoder_sparse_step``) hold nothing
  meaningful.
- SGLang (``return_routed_experts``): ``meta_info["routed_experts"]``, the base64 of the raw
  little-endian int32 bytes of ``[tokens, num_hidden_layers, top_k]`` (no shape travels with
  it; in process a newer SGLang gives the same string, an older one may give the array).

``tokens`` is prompt + generated - 1 (the last sampled token was never run): one row per token
the engine ran, in order, prompt included, as the embedded engine records them. Both layouts
are accepted with the layer axis counting either every layer or the MoE layers only; the MoE
layers' columns are kept (``RolloutSample.routes`` counts MoE layers, from 0).

Checked here, naming the request and sample: the layer and top-k axes, the number of rows
(exact for a finished request; of a cut one the first ``tokens - 1`` are kept, and fewer mean
its later tokens have no route: the actor routes them live), expert ids in ``[0,
num_experts)`` and distinct per row.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from bapo_megatron.config import ModelConfig


def moe_columns(model: ModelConfig, layers: int, where: str) -> list[int]:
    """Which of an engine's ``layers`` layer columns are ``model``'s MoE layers, in order."""
    pattern = model.moe.moe_layer_pattern(model.num_layers)
    moe_layers = sum(pattern)
    if layers == model.num_layers:
        return [i for i, sparse in enumerate(pattern) if sparse]
    if layers == moe_layers:
        return list(range(moe_layers))
    raise ValueError(
        f"{where}: routed experts for {layers} layers; the model has {model.num_layers} "
        f"layers, {moe_layers} of them with experts"
    )


def decode_routes(
    routes: Any, model: ModelConfig, *, tokens: int, finished: bool, where: str
) -> list[list[list[int]]]:
    """``routes`` (an engine's ``[rows, layers, top_k]`` expert ids) as
    ``RolloutSample.routes`` of a sample whose context plus generated tokens number ``tokens``:
    ``tokens - 1`` rows when ``finished``; of a cut request, the first ``tokens - 1`` at most.
    ``ValueError`` naming ``where`` when anything does not fit the model."""
    array = np.asarray(routes)
    moe = model.moe
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(
            f"{where}: routed experts must be integer [tokens, layers, top_k], got shape "
            f"{array.shape} of {array.dtype}"
        )
    rows, layers, topk = array.shape
    if topk != moe.num_experts_per_tok:
        raise ValueError(
            f"{where}: routed experts hold {topk} experts per token, the model routes to "
            f"num_experts_per_tok={moe.num_experts_per_tok}"
        )
    expected = max(tokens - 1, 0)
    if finished and rows != expected:
        raise ValueError(
            f"{where}: routed experts for {rows} tokens; the sample ran {expected} (its "
            "context and generated tokens but the last)"
        )
    # a cut request: rows past the tokens it kept are dropped, the missing ones route live
    array = array[:expected, moe_columns(model, layers, where)].astype(np.int64)
    bad = (array < 0) | (array >= moe.num_experts)
    if bad.any():
        token, layer = (int(x) for x in np.argwhere(bad)[0][:2])
        raise ValueError(
            f"{where}: token {token}, MoE layer {layer}: expert id out of range "
            f"[0, {moe.num_experts}) ({array[token, layer].tolist()})"
        )
    ordered = np.sort(array, axis=-1)
    twice = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
    if twice.any():
        token, layer = (int(x) for x in np.argwhere(twice)[0])
        raise ValueError(
            f"{where}: token {token}, MoE layer {layer}: the same expert twice "
            f"({array[token, layer].tolist()})"
        )
    return array.tolist()


def _base64_bytes(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(  # noqa: TRY004 - a malformed answer, reported like every other
            f"{where}: routed experts should be a base64 string, got {type(text).__name__}"
        )
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"{where}: routed experts are not valid base64 ({error})") from None


def routes_from_npy_base64(text: Any, where: str) -> np.ndarray:
    """vLLM's server encoding: base64 of an ``.npy`` file (pickles refused)."""
    data = _base64_bytes(text, where)
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise ValueError(f"{where}: routed experts are not an .npy array ({error})") from None


def routes_from_int32_base64(text: Any, model: ModelConfig, where: str) -> np.ndarray:
    """SGLang's encoding: base64 of raw little-endian int32 ``[tokens, layers, top_k]``, the
    layer axis every layer (as SGLang writes it) or, failing that, the MoE layers only. An
    array (an older in-process SGLang) is taken as it is."""
    if not isinstance(text, str):
        return np.asarray(text)
    data = _base64_bytes(text, where)
    if len(data) % 4:
        raise ValueError(f"{where}: routed experts hold {len(data)} bytes, not whole int32s")
    values = np.frombuffer(data, dtype="<i4")
    topk = model.moe.num_experts_per_tok
    for layers in (model.num_layers, model.moe.num_moe_layers(model.num_layers)):
        if values.size % (layers * topk) == 0:
            return values.reshape(-1, layers, topk)
    raise ValueError(
        f"{where}: {values.size} routed expert ids are not whole tokens of "
        f"{model.num_layers} layers x top-{topk}"
    )
