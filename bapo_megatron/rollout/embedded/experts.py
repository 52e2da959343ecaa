"""Mixture-of-experts models in the embedded engine (transformers' Qwen3-MoE): the experts each
token was routed to. (Per-expert weights go into transformers' fused expert tensors through
:func:`bapo_megatron.models.experts.fused_expert_view`.)

:class:`RouteRecorder` hooks each router (``mlp.gate``, which returns logits, weights and the
top-k expert indices of every token) and hands back, per model call, the ``[batch, tokens,
moe_layers, topk]`` indices of that call.
"""

from __future__ import annotations

import torch


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
