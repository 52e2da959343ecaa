"""The device check's passes: the base pass (what the GPU image runs as it is), the Transformer
Engine pass (``--spec te``: the actor, the loop and the conversion built from TE's layers, and
FP8) and the vLLM pass (``--only vllm``: the vLLM adapter on the device, and the loop colocated
with vLLM). The TE and vLLM passes need those packages installed (docs/install.md); where they
are missing a pass is refused with the reason, before any check starts. What the run did not
cover is listed in its report.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Iterable

import torch

TE_CHECKS = (
    "actor_tiny",
    "actor_moe",
    "actor_small",
    "actor_fp8",
    "packing",
    "conversion",
    "loop_tiny",
    "resume",
    "loop_moe",
)
"""The TE pass's checks by default: the actor's train steps against the float32 CPU reference
(dense, MoE, ~0.5B, and the ~0.5B model in FP8 with each recipe Hopper runs), packed rows through
TE's THD attention against padded rows, HF -> Megatron -> HF with TE's fused norm names, the
loop, a SIGKILLed run resumed, the MoE loop."""
VLLM_CHECKS = ("vllm_engine", "vllm_engine_fp8", "loop_vllm")
"""The vLLM pass's checks (``--only vllm``): the adapter against the actor on the device (its
FP8 variant on a GPU only), and the loop colocated with vLLM."""
GPU_ONLY = {"vllm_engine_fp8": "FP8 needs a CUDA GPU (vLLM's CPU build has no FP8)"}
NAMED_ONLY = frozenset({"actor_fp8", *VLLM_CHECKS})
"""Checks that run only when named (by ``--only`` or their pass): they need TE or vLLM."""

TE_MODULES = ("transformer_engine", "megatron.core.extensions.transformer_engine")
"""Where the classes of Transformer Engine's layers (and Megatron's wrappers of them) live."""

NOT_RUN = {
    "multi-GPU NCCL (TP/PP/DP on CUDA, NCCL weight broadcast)": "the device check uses one GPU; "
    "NCCL refuses two ranks on one device",
    "Transformer Engine layers and FP8": "the TE pass (--spec te), with Transformer Engine "
    "installed; see docs/gpu-check.md",
    "vLLM on a GPU": "the vLLM pass (--only vllm), with vLLM installed; see docs/gpu-check.md",
    "SGLang on a GPU": "the device check has no SGLang pass",
    "Transformer Engine's fused attention": "it comes with Transformer Engine (the TE pass); "
    "without it the local layer spec's attention (torch SDPA) runs",
}
FP8_LOOP = (
    "FP8 through the loop",
    "the trainer's micro-batches are not yet padded to parallel.fp8_length_multiple (the "
    "packing change); the actor_fp8 check trains fixed-length batches",
)


def wanted_checks(args: argparse.Namespace) -> set[str] | None:
    """The checks this invocation runs (None: every check of the base pass). ``--only`` takes
    check names, and ``vllm`` for the vLLM pass's; ``--spec te`` without ``--only`` runs
    :data:`TE_CHECKS`."""
    if args.only:
        names: set[str] = set()
        for name in args.only.split(","):
            names.update(VLLM_CHECKS if name == "vllm" else (name,))
        return names
    return set(TE_CHECKS) if args.spec == "te" else None


def selected(name: str, wanted: set[str] | None) -> bool:
    """Whether check ``name`` runs, for :func:`wanted_checks`' answer ``wanted``."""
    return name in wanted if wanted is not None else name not in NAMED_ONLY


def te_import_error() -> str | None:
    """Why ``import transformer_engine.pytorch`` fails in a fresh interpreter (its last error
    line), or None when it imports. In a child process: a broken extension build can abort
    the interpreter, and modules of this package import TE only through Megatron."""
    done = subprocess.run(
        [sys.executable, "-c", "import transformer_engine.pytorch"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
    return lines[-1]


def refusal(args: argparse.Namespace, wanted: set[str] | None) -> str | None:
    """Why this invocation cannot run at all (the packages of its pass are missing, or the
    device does not fit it), or None."""
    if args.spec == "te":
        if importlib.util.find_spec("transformer_engine") is None:
            return (
                "--spec te: Transformer Engine is not installed (pip install "
                "--no-build-isolation 'bapo-megatron[te]', docs/install.md)"
            )
        if args.device != "cuda":
            return "--spec te: Transformer Engine's layers run on CUDA only (--device cuda)"
        error = te_import_error()
        if error is not None:
            return f"--spec te: Transformer Engine is installed but does not import: {error}"
    if wanted and wanted & set(VLLM_CHECKS) and importlib.util.find_spec("vllm") is None:
        return (
            "vLLM checks: vLLM is not installed (on a GPU: requirements-vllm-gpu.txt, "
            "docs/install.md; on a CPU: the vLLM tier's environment, requirements-vllm.txt)"
        )
    return None


def not_run(args: argparse.Namespace, ran: Iterable[str]) -> dict[str, str]:
    """What this run did not cover, with the reason."""
    ran = set(ran)
    left = dict(NOT_RUN)
    if args.spec == "te":
        left.pop("Transformer Engine layers and FP8")
        left.pop("Transformer Engine's fused attention")
        left[FP8_LOOP[0]] = FP8_LOOP[1]
    if ran & set(VLLM_CHECKS):
        left.pop("vLLM on a GPU")
    return left


def layer_spec_of(chunks: Iterable[torch.nn.Module]) -> str:
    """`te` when the model holds Transformer Engine's layers, else `local`."""
    for chunk in chunks:
        for module in chunk.modules():
            if type(module).__module__.startswith(TE_MODULES):
                return "te"
    return "local"


def fused_norm_parameters(chunks: Iterable[torch.nn.Module]) -> int:
    """Parameters named as TE's fused layers name the pre-norm weights (``layer_norm_weight``
    of ``linear_qkv`` / ``linear_fc1``)."""
    return sum(
        name.endswith(".layer_norm_weight")
        for chunk in chunks
        for name, _ in getattr(chunk, "module", chunk).named_parameters()
    )
