"""The embedded engine (transformers' model, our sampler; on the CPU or the rank's GPU): the
default rollout engine.

The family's builder for :mod:`bapo_megatron.rollout.registry` lives here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bapo_megatron.rollout.embedded.engine import EmbeddedEngine

if TYPE_CHECKING:
    from bapo_megatron.rollout.engine_setup import EngineSetup
    from bapo_megatron.rollout.protocol import RolloutEngine

FAMILY = "embedded"
"""Its ``rollout.engine`` kind (it has no server client)."""


def start_in_process(setup: EngineSetup) -> RolloutEngine:
    """An embedded engine with random weights (the trainer pushes its own before rolling out);
    for a mixture-of-experts model it records each token's experts."""

    return EmbeddedEngine(
        setup.model,
        pad_token_id=setup.pad_token_id,
        record_routes=setup.model.is_moe,
        device=setup.device,
    )
