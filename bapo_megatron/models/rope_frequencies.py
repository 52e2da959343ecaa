"""The rotary embedding's inverse frequencies, computed the way transformers computes them, and
installed into Megatron's ``RotaryEmbedding``.

megatron-core 0.16.1 has its own Llama 3.x scaling (``GPTModel(rope_scaling=True,
rope_scaling_factor=...)``, ``RotaryEmbedding._apply_scaling``), but it takes only the factor:
``low_freq_factor=1``, ``high_freq_factor=4`` and ``original_max_position_embeddings=8192`` are
fixed there. Those are Llama 3.1/3.2's published values, not a property of the rope type, and the
engines (transformers, vLLM, SGLang) read all four from the config. So Megatron's scaling is left
off, and :func:`install_rope_frequencies` replaces the plain frequencies Megatron computed with
:func:`rope_inverse_frequencies`, transformers' ``_compute_llama3_parameters`` step for step. The
seam is the ``inv_freq`` attribute, which is everything Megatron's ``RotaryEmbedding`` derives
its angles from (``get_freqs_non_repeated``); it is set before the first forward, whose result
Megatron caches per sequence length.
"""

from __future__ import annotations

import math

import torch

from bapo_megatron.models.architecture import Architecture


def rope_inverse_frequencies(model: Architecture) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies (float32) of ``model``'s rotary embedding, as
    transformers computes them: ``1 / rope_theta ** (2i / head_dim)``, then, with
    ``rope_scaling`` (llama3), low frequencies divided by ``factor`` and the band between the two
    wavelength bounds interpolated smoothly."""
    dim = model.head_dim
    # on the CPU whatever the default device (the layout planner builds under a meta one)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (model.rope_theta**exponents)
    scaling = model.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    low_freq_factor, high_freq_factor = scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelength below high_freq_wavelen: kept; above low_freq_wavelen: divided by factor
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # in between: interpolated (the same expression, in the same order, as transformers')
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def install_rope_frequencies(chunk: torch.nn.Module, model: Architecture) -> None:
    """Give the rotary embedding of the model chunk ``chunk`` (a ``GPTModel``) the inverse
    frequencies of :func:`rope_inverse_frequencies`, on the device of the ones it has. Plain
    RoPE is left as Megatron computed it (the same values). Call before the first forward."""
    if model.rope_scaling is None:
        return
    rotary = chunk.rotary_pos_emb
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise TypeError(  # a megatron-core whose RotaryEmbedding moved its frequencies
            f"{type(rotary).__name__} has no inv_freq tensor to install llama3 frequencies into"
        )
    rotary.inv_freq = rope_inverse_frequencies(model).to(rotary.inv_freq.device)
