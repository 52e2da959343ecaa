"""Mixture-of-experts models in the embedded engine (transformers' Qwen3-MoE): per-expert weights
into transformers' fused expert tensors, and the experts each token was routed to.

transformers 5 keeps a sparse layer's experts fused in memory, ``mlp.experts.gate_up_proj``
``[E, 2 I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``
``[E, H, I]``, while checkpoints on disk and the live export name them per expert,
``mlp.experts.{e}.gate_proj.weight`` ``[I, H]`` etc.: :func:`fused_expert_view` finds the slice of
the fused tensor one per-expert tensor fills.

:class:`RouteRecorder` hooks each router (``mlp.gate``, which returns logits, weights and the
top-k expert indices of every token) and hands back, per model call, the ``[batch, tokens,
moe_layers, topk]`` indices of that call.
"""

from __future__ import annotations

import re

import torch

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


class RouteRecorder:
    """Records the top-k expert indices of every router of ``model`` (in layer order) for each
    model call between :meth:`start` and :meth:`take`."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [
            module
            for name, module in model.named_modules()
            if name.endswith(".mlp.gate") and hasattr(module, "top_k")
        ]
        if not self.routers:
            raise ValueError("RouteRecorder: the model has no mixture-of-experts router")
        self._captured: list[torch.Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        self._captured.append(output[2].detach())  # [batch * tokens, topk], batch-major

    def start(self) -> None:
        """Forget what earlier calls recorded."""
        self._captured = []

    def take(self, batch: int, tokens: int) -> torch.Tensor:
        """``[batch, tokens, moe_layers, topk]`` expert ids of the model call since
        :meth:`start`."""
        if len(self._captured) != len(self.routers):
            raise AssertionError(
                f"RouteRecorder: {len(self._captured)} router calls for {len(self.routers)} "
                "routers in one model call"
            )
        routes = torch.stack([c.view(batch, tokens, -1) for c in self._captured], dim=2)
        self._captured = []
        return routes
