"""Which device a run computes on: the one decision behind the backend (NCCL or gloo), the CPU
runtime patches, Megatron's CPU initialization and the embedded engine's placement.

``parallel.device`` chooses it: ``cpu`` and ``cuda`` are taken as said; ``auto`` is CUDA when
torch sees a GPU, else the CPU, unless the environment variable :data:`DEVICE_ENV` names one of
the two. The variable exists for test suites and tools that must run on the CPU on a machine
with a GPU (this repository's suite sets it, so that it runs the same on a laptop and on a GPU
node) without editing every configuration; a configuration that names a device wins over it.
"""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "BAPO_DEVICE"
"""Environment variable that ``parallel.device: auto`` follows when it is set (`cpu` or
`cuda`)."""


def resolve_device(choice: str = "auto") -> str:
    """``"cpu"`` or ``"cuda"`` for the setting ``choice`` (see the module docstring). Raises
    ``ValueError`` naming the setting when it asks for CUDA where torch sees no GPU, or when
    :data:`DEVICE_ENV` holds something else than `cpu` or `cuda`."""
    where = "parallel.device"
    if choice == "auto":
        from_env = os.environ.get(DEVICE_ENV, "").strip()
        if not from_env:
            return "cuda" if torch.cuda.is_available() else "cpu"
        choice, where = from_env, f"environment variable {DEVICE_ENV}"
    if choice not in ("cpu", "cuda"):
        raise ValueError(f"{where} must be `cpu` or `cuda`, got {choice!r}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where} is `cuda`, but torch sees no CUDA GPU on this machine")
    return choice


def uses_cuda(choice: str = "auto") -> bool:
    """Whether the setting ``choice`` resolves to CUDA."""
    return resolve_device(choice) == "cuda"
