"""The RoPE variants of the families and their two Hugging Face spellings.

transformers 4 puts ``rope_theta`` at the top level of ``config.json`` and any scaling in
``rope_scaling``; transformers 5 puts both inside ``rope_parameters``. Both are read. Only plain
RoPE and ``rope_type: llama3`` (Llama 3.x's frequency scaling) are represented; anything else
(YaRN, linear, dynamic NTK, longrope, partial rotary) is refused naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
"""The HF ``rope_type`` values represented: plain RoPE and Llama 3.x's scaling."""

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The fields of a ``rope_type: llama3`` scaling."""

_TYPE_KEYS = ("rope_type", "type")  # transformers 4 also accepted `type`


class Llama3Scaling(Protocol):
    """What :func:`hf_rope_fields` reads of a llama3 scaling (``config.rope.Llama3RopeScaling``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_fields_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``rope_theta`` and ``rope_scaling`` fields of ``ModelConfig`` from the HF config
    ``hf`` (either spelling). The two spellings must agree where both are given; a rope type
    other than ``default`` / ``llama3``, a key not implemented, or a
    ``partial_rotary_factor`` other than 1 raise ``ValueError`` naming ``where`` and the field."""
    theta = hf.get("rope_theta")
    scalings: dict[str, dict[str, Any] | None] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ValueError(f"HF config {where}: {key} must be a mapping or null, got {value!r}")
        nested = value.get("rope_theta")
        if nested is not None:
            if theta is not None and nested != theta:
                raise ValueError(
                    f"HF config {where}: rope_theta={theta!r} and {key}.rope_theta={nested!r} "
                    "disagree"
                )
            theta = nested
        scalings[key] = _scaling_of(value, key, where)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"HF config {where}: partial_rotary_factor={hf['partial_rotary_factor']!r} is not "
            "supported (rotary embeddings cover the whole head)"
        )
    if len(scalings) == 2 and scalings["rope_scaling"] != scalings["rope_parameters"]:
        raise ValueError(
            f"HF config {where}: rope_scaling={hf['rope_scaling']!r} and "
            f"rope_parameters={hf['rope_parameters']!r} disagree"
        )
    scaling = next(iter(scalings.values()), None)
    return {"rope_theta": 10000.0 if theta is None else theta, "rope_scaling": scaling}


def _scaling_of(value: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
    """The llama3 scaling fields of one rope mapping, or None for plain RoPE."""
    rope_type = next((value[k] for k in _TYPE_KEYS if k in value), "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"HF config {where}: {key}.rope_type={rope_type!r} is not supported (only plain "
            "RoPE and rope_type 'llama3' are implemented)"
        )
    if value.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"HF config {where}: {key}.partial_rotary_factor="
            f"{value['partial_rotary_factor']!r} is not supported (rotary embeddings cover the "
            "whole head)"
        )
    allowed = {*_TYPE_KEYS, "rope_theta", "partial_rotary_factor"}
    if rope_type == "llama3":
        allowed.update(LLAMA3_KEYS)
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(
            f"HF config {where}: {key}.{unknown[0]} is not supported for rope_type "
            f"{rope_type!r} (it would change the rotary embedding)"
        )
    if rope_type == "default":
        return None
    missing = [k for k in LLAMA3_KEYS if value.get(k) is None]
    if missing:
        raise ValueError(
            f"HF config {where}: {key}.{missing[0]} is missing (rope_type 'llama3' needs "
            f"{list(LLAMA3_KEYS)})"
        )
    return {k: value[k] for k in LLAMA3_KEYS}


def hf_rope_fields(rope_theta: float, scaling: Llama3Scaling | None) -> dict[str, Any]:
    """The HF ``config.json`` fields of a rotary embedding, in the transformers 4 spelling
    (top-level ``rope_theta``, ``rope_scaling``), which transformers 5 reads too."""
    fields: dict[str, Any] = {"rope_theta": rope_theta}
    if scaling is not None:
        fields["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return fields
