"""The pretrained model of the real-model tier (.ci/real-model-tier, docs/testing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MODEL_VARIABLE = "BAPO_REAL_MODEL"
"""Names the HF folder of SmolLM2-135M-Instruct the tier converted from its GGUF wheel."""


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The HF folder ``$BAPO_REAL_MODEL`` names. The tier always sets it; a missing or
    incomplete folder fails the test rather than skipping it (not one test of the tier may
    skip)."""
    value = os.environ.get(MODEL_VARIABLE)
    if not value:
        pytest.fail(
            f"{MODEL_VARIABLE} is not set: run the tier with .ci/real-model-tier, which "
            "prepares the model and sets it"
        )
    folder = Path(value)
    missing = [
        name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()
    ]
    if missing:
        pytest.fail(f"{MODEL_VARIABLE}={folder} is not a converted HF folder (no {missing})")
    return folder
