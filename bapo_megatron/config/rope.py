"""Llama 3.x's rotary frequency scaling (``model.rope_scaling``); its Hugging Face spellings are
read by :mod:`bapo_megatron.models.rope`."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class Llama3RopeScaling:
    """Llama 3.x's RoPE frequency scaling (HF ``rope_type: llama3``), in transformers' terms
    (``_compute_llama3_parameters``): of the plain inverse frequencies, those whose wavelength
    is below ``original_max_position_embeddings / high_freq_factor`` are kept, those above
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and those
    in between are interpolated smoothly between the two."""

    factor: float
    """Divisor of the low frequencies (Llama 3.1: 8, Llama 3.2: 32)."""
    low_freq_factor: float
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled."""
    high_freq_factor: float
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept; must
    exceed low_freq_factor."""
    original_max_position_embeddings: int
    """The context length the model was pretrained at, before scaling (Llama 3: 8192)."""

    def __post_init__(self) -> None:
        prefix = "model.rope_scaling"
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"{prefix}.factor must be a finite number >= 1, got {self.factor!r}")
        if not (math.isfinite(self.low_freq_factor) and self.low_freq_factor > 0):
            raise ValueError(
                f"{prefix}.low_freq_factor must be a finite number > 0, "
                f"got {self.low_freq_factor!r}"
            )
        if not (
            math.isfinite(self.high_freq_factor) and self.high_freq_factor > self.low_freq_factor
        ):
            raise ValueError(
                f"{prefix}.high_freq_factor ({self.high_freq_factor!r}) must be a finite number "
                f"greater than {prefix}.low_freq_factor ({self.low_freq_factor!r})"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"{prefix}.original_max_position_embeddings must be a positive integer, "
                f"got {self.original_max_position_embeddings!r}"
            )
