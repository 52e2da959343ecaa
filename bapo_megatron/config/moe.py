"""The mixture-of-experts part of a policy's architecture (the ``model.moe`` section); its
Hugging Face ``config.json`` form is read and written by :mod:`bapo_megatron.models.experts`.

A family with experts is a dense family plus this section: Qwen3-MoE is Qwen3's attention (q/k
RMSNorm, its own head_dim) with the SwiGLU MLP of the sparse layers replaced by ``num_experts``
SwiGLU experts of width ``moe_intermediate_size`` behind a softmax top-k router. What Qwen3-MoE
does not have (shared experts, sigmoid or grouped routers, a router bias) is refused naming the
field, so a model with any of them is never loaded as a silently different one. Another MoE
family is a name map plus a mapping in ``models.experts.MOE_FAMILY_FIELDS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(kw_only=True)
class MoeConfig:
    """Qwen3-MoE's experts: each sparse layer's MLP is ``num_experts`` SwiGLU experts, of which a
    softmax router picks ``num_experts_per_tok`` per token. Field names are the HF config.json's.
    """

    num_experts: int
    """Experts per MoE layer (HF ``num_experts``; Qwen3-30B-A3B: 128)."""
    num_experts_per_tok: int
    """Experts each token is routed to, top-k of the router's scores (HF
    ``num_experts_per_tok``; Qwen3-MoE: 8)."""
    moe_intermediate_size: int
    """Width of each expert's SwiGLU MLP, per gate/up projection (HF
    ``moe_intermediate_size``; Qwen3-30B-A3B: 768)."""
    norm_topk_prob: bool = True
    """Whether the top-k routing weights are renormalized to sum to 1 (softmax over the chosen
    experts' logits, Megatron ``moe_router_pre_softmax=False``); false keeps the softmax over
    all experts (``moe_router_pre_softmax=True``)."""
    decoder_sparse_step: int = 1
    """Every this many layers is an MoE layer: layer i (from 0) is sparse when
    (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers; the others keep the
    dense MLP of width ``model.ffn_hidden_size``."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers (from 0) that keep the dense MLP whatever decoder_sparse_step says."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing auxiliary loss (Switch Transformer form, per MoE layer,
    summed over layers) added to the BAPO loss in training; 0 turns it off."""

    def validate(self, num_layers: int, prefix: str = "model.moe") -> None:
        """Check ranges and the fit with a model of ``num_layers`` layers; ``ValueError``
        naming the field."""
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{prefix}.{name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"{prefix}.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                f"{prefix}.num_experts ({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(
                f"{prefix}.decoder_sparse_step must be a positive integer, "
                f"got {self.decoder_sparse_step!r}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"{prefix}.mlp_only_layers: layers {bad} do not exist in a model of "
                f"{num_layers} layers"
            )
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(
                f"{prefix}.router_aux_loss_coef must be a finite number >= 0, "
                f"got {self.router_aux_loss_coef!r}"
            )
        if not any(self.moe_layer_pattern(num_layers)):
            raise ValueError(
                f"{prefix}: decoder_sparse_step={self.decoder_sparse_step} and "
                f"mlp_only_layers={list(self.mlp_only_layers)} leave no MoE layer"
            )

    def moe_layer_pattern(self, num_layers: int) -> list[bool]:
        """Per layer (from 0): whether its MLP is the experts (HF Qwen3-MoE's rule)."""
        return [
            (i + 1) % self.decoder_sparse_step == 0 and i not in self.mlp_only_layers
            for i in range(num_layers)
        ]

    def num_moe_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers have experts."""
        return sum(self.moe_layer_pattern(num_layers))
