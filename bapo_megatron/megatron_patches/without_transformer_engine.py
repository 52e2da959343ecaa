"""Runtime patches for megatron-core without Transformer Engine, on any device.

The CPU patches (:mod:`bapo_megatron.megatron_patches.cpu_runtime`) are only for CPU runs; a GPU
image without Transformer Engine (the local layer spec) hits the sites here as well, so
:func:`apply_without_te_patches` is applied by every run, whatever ``parallel.device`` is. Each
patch first checks that its site is still broken in the installed release and does nothing
otherwise, so it needs no version pin: a newer megatron-core that fixed the site, or an image
with Transformer Engine, is left as it is. This folder's ``README.md`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron.core.transformer.moe import moe_utils

_APPLIED: list[str] = []


def _patch_moe_router_gemm_without_te() -> bool:
    """``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, but
    megatron-core 0.16 binds the name only inside its ``try: import transformer_engine`` block,
    so without TE every MoE router forward raises ``NameError``, on the GPU as on the CPU (the
    GPU check found it; fixed upstream in core 0.17). Binding it to None sends the function down
    its own ``torch.mm`` branch. Returns whether the site needed it."""
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


WITHOUT_TE_PATCHES: dict[str, Callable[[], bool]] = {
    "moe_router_gemm_without_te": _patch_moe_router_gemm_without_te,
}


def apply_without_te_patches() -> tuple[str, ...]:
    """Install each patch whose site is broken in this process's megatron-core (once; calling
    again is a no-op) and return the names installed so far."""
    for name, patch in WITHOUT_TE_PATCHES.items():
        if name not in _APPLIED and patch():
            _APPLIED.append(name)
    return tuple(_APPLIED)
