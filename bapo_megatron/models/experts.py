"""The experts of the mixture-of-experts families: their Hugging Face ``config.json`` fields
(read, refused, written) and their placement over expert-parallel ranks.

Qwen3-MoE is Qwen3's attention with the SwiGLU MLP of the sparse layers replaced by
``num_experts`` SwiGLU experts behind a softmax top-k router. What it does not have (shared
experts, sigmoid or grouped routers, a router bias) is refused naming the field, so a model with
any of them is never loaded as a silently different one. Megatron places the experts of a layer
in contiguous blocks: expert-parallel rank ``r`` of ``ep`` holds experts
``[r E/ep, (r+1) E/ep)`` (:func:`local_experts`), each split over the expert tensor-parallel group
as a dense MLP is over the tensor-parallel group (the name maps' ``ParamRule.expert``).

transformers 5 keeps a sparse layer's experts fused in memory, ``mlp.experts.gate_up_proj``
``[E, 2 I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``
``[E, H, I]``, while checkpoints on disk and the live export name them per expert,
``mlp.experts.{e}.gate_proj.weight`` ``[I, H]`` etc.: :func:`fused_expert_view` finds the slice of
the fused tensor one per-expert tensor fills.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the tables are read by config, which does not load torch
    import torch

MOE_FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "qwen3_moe": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "router_aux_loss_coef",
    ),
}
"""HF config.json fields of each MoE family that this section reads (same names as here)."""

MOE_FIELD_SPELLINGS: dict[str, dict[str, str]] = {
    "qwen3_moe": {"num_local_experts": "num_experts"},
}
"""Other spellings of a family's fields: transformers 5 writes Qwen3-MoE's ``num_experts`` as
``num_local_experts`` (its attribute map); the published configs write ``num_experts``."""

UNSUPPORTED_MOE_FIELDS: dict[str, str] = {
    "n_shared_experts": "shared experts are not implemented (Qwen2-MoE, DeepSeek have them)",
    "shared_expert_intermediate_size": "shared experts are not implemented",
    "n_routed_experts": "DeepSeek-style routed experts are a different family",
    "num_local_experts": "Mixtral-style experts are a different family",
    "n_group": "grouped (device-limited) routing is not implemented",
    "topk_group": "grouped (device-limited) routing is not implemented",
    "routed_scaling_factor": "scaled routing weights are not implemented",
    "moe_layer_freq": "only decoder_sparse_step / mlp_only_layers place the MoE layers",
}
"""HF fields of other MoE variants: any of them set (non-zero, non-null) is refused."""

SUPPORTED_ROUTER_SCORES = ("softmax",)
"""Router score functions implemented (HF ``scoring_func``): Qwen3-MoE's softmax."""


class Experts(Protocol):
    """What is read here of a ``model.moe`` section (``config.moe.MoeConfig``)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    router_aux_loss_coef: float

    def moe_layer_pattern(self, num_layers: int) -> list[bool]: ...


def local_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global indices of the experts expert-parallel rank ``ep_rank`` of ``ep_size`` holds."""
    if num_experts % ep_size:
        raise ValueError(
            f"{num_experts} experts cannot be split over {ep_size} expert-parallel ranks"
        )
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def moe_fields_from_hf(hf: Mapping[str, Any], model_type: str, where: str) -> dict[str, Any] | None:
    """The ``model.moe`` fields of the HF config ``hf`` (None for a dense family), refusing the
    fields of MoE variants this model cannot represent, naming ``where`` and the field."""

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"HF config {where}: {key}={hf[key]!r} is not supported ({why})")

    spellings = MOE_FIELD_SPELLINGS.get(model_type, {})
    for key, why in UNSUPPORTED_MOE_FIELDS.items():
        if hf.get(key) and key not in spellings:
            refuse(key, why)
    if model_type not in MOE_FAMILY_FIELDS:
        return None
    hf = dict(hf)
    for other, name in spellings.items():
        if hf.get(other) is None:
            continue
        if hf.get(name) is not None and hf[name] != hf[other]:
            raise ValueError(
                f"HF config {where}: {name}={hf[name]!r} and {other}={hf[other]!r} disagree "
                "(two spellings of one field)"
            )
        hf[name] = hf[other]
    scoring = hf.get("scoring_func")
    if scoring is not None and scoring not in SUPPORTED_ROUTER_SCORES:
        refuse("scoring_func", f"routers implemented: {list(SUPPORTED_ROUTER_SCORES)}")
    if hf.get("output_router_logits") is not None and not isinstance(
        hf["output_router_logits"], bool
    ):
        refuse("output_router_logits", "expected true or false")
    required = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    for key in required:
        if hf.get(key) is None:
            raise ValueError(f"HF config {where}: required field {key!r} is missing")
    return {key: hf[key] for key in MOE_FAMILY_FIELDS[model_type] if hf.get(key) is not None}


def hf_moe_fields(moe: Experts) -> dict[str, Any]:
    """The HF config.json fields of ``moe`` (inverse of :func:`moe_fields_from_hf`)."""
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": moe.decoder_sparse_step,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "router_aux_loss_coef": moe.router_aux_loss_coef,
    }


_PER_EXPERT = re.compile(
    r"^(?P<experts>model\.layers\.\d+\.mlp\.experts)\.(?P<expert>\d+)\."
    r"(?P<projection>gate_proj|up_proj|down_proj)\.weight$"
)


def fused_expert_view(name: str, params: dict[str, torch.nn.Parameter]) -> torch.Tensor | None:
    """The view of a fused expert parameter that the per-expert HF tensor ``name`` fills, or
    None when ``name`` is not a per-expert name or the model has no such fused parameter."""
    found = _PER_EXPERT.match(name)
    if found is None:
        return None
    experts, expert = found["experts"], int(found["expert"])
    if found["projection"] == "down_proj":
        fused = params.get(f"{experts}.down_proj")
        return None if fused is None or expert >= fused.shape[0] else fused[expert]
    fused = params.get(f"{experts}.gate_up_proj")
    if fused is None or expert >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    rows = slice(0, half) if found["projection"] == "gate_proj" else slice(half, None)
    return fused[expert, rows]
