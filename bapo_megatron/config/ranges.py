"""The range check most sections share: an integer field's lower bound, with the dotted key.

Value types are checked once, by :func:`~bapo_megatron.config.value_types.build_dataclass`; the
sections check what a type cannot say (ranges, choices, relations between their fields)."""

from __future__ import annotations


def require_at_least(value: int, low: int, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` (the dotted key) when ``value`` is below ``low``."""
    if value < low:
        raise ValueError(f"{where} must be an integer >= {low}, got {value!r}")
