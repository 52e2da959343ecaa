"""Megatron-Core's "Transformer Engine / Apex not installed" warnings, silenced.

Megatron-Core warns at import, once per module, that it falls back to torch implementations when
Transformer Engine or NVIDIA Apex is missing. That is always the case on the CPU, where the
fallback is the intended path, so the warnings say nothing; the project's docs say which paths
need either package. :func:`quiet_missing_accelerator_warnings` is called by the command lines
(:mod:`bapo_megatron.process.start`), so it is in force before any module imports
megatron.
"""

from __future__ import annotations

import warnings

MISSING_ACCELERATOR = r".*(Transformer Engine|Apex).* not installed"


def quiet_missing_accelerator_warnings() -> None:
    """Ignore Megatron-Core's warnings that Transformer Engine or Apex is not installed (a
    process-wide warnings filter; other warnings are untouched)."""
    warnings.filterwarnings("ignore", message=MISSING_ACCELERATOR, category=UserWarning)
