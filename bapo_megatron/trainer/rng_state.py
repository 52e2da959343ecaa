"""Every random generator a training step may draw from, as plain data for a checkpoint.

The states are stored as tensors, numbers and lists only (no NumPy arrays, no tuples of
unknown types), so the per-rank checkpoint file that holds them loads with
``torch.load(weights_only=True)``; :func:`restore` puts back exactly what :func:`capture` saw.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel


def capture() -> dict[str, Any]:
    """This rank's generator states: torch CPU, CUDA when present, Python ``random``, NumPy's
    global generator and Megatron's model-parallel tracker (dropout inside tensor-parallel
    regions; CPU generator states on the CPU, see megatron_patches/cpu_runtime.py)."""
    python_version, python_words, python_gauss = random.getstate()
    numpy_name, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": python_version, "words": list(python_words), "gauss": python_gauss},
        "numpy": {
            "name": numpy_name,
            "keys": torch.from_numpy(numpy_keys.astype(np.int64)),
            "pos": int(numpy_pos),
            "has_gauss": int(numpy_has_gauss),
            "gauss": float(numpy_gauss),
        },
        "megatron_tracker": {
            name: state.clone()
            for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }
    # Only a process that computes on the GPU has a CUDA generator worth keeping (asking for it
    # would initialize CUDA in a CPU run on a GPU machine).
    if torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore(states: dict[str, Any]) -> None:
    """Put back what :func:`capture` recorded."""
    torch.set_rng_state(states["torch"])
    python = states["python"]
    random.setstate((python["version"], tuple(python["words"]), python["gauss"]))
    numpy = states["numpy"]
    np.random.set_state(
        (
            numpy["name"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["gauss"],
        )
    )
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(states["megatron_tracker"]))
    if "cuda" in states and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(states["cuda"])
