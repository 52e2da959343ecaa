"""Building a configuration dataclass from a plain tree (parsed YAML, a JSON ``config.json``):
the one place value types are checked, against the dataclass's annotations.

Values are never converted between types: a string is refused where a number is expected,
``true`` is not a number, and ``2.0`` is not an integer; an integer is accepted where a float is
expected (and becomes a float). Errors name the dotted field and what YAML read the value as.
The sections check their values' ranges and relations themselves, in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


def build_dataclass(cls: type[T], data: Any, prefix: str) -> T:
    """Instantiate dataclass ``cls`` from a mapping, checking keys and value types recursively."""
    where = prefix or "<root>"
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004 - every config error is a ValueError
            f"{where}: expected a mapping for {cls.__name__}, got {_describe(data)}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {unknown}; {cls.__name__} has {sorted(fields)}"
        )
    kwargs = {
        name: _coerce(hints[name], value, _join(prefix, name)) for name, value in data.items()
    }
    try:
        if "preset" in kwargs and hasattr(cls, "from_preset"):
            return cls.from_preset(kwargs.pop("preset"), **kwargs)
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{where}: {err}") from None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ValueError(f"{where}: null is not allowed")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError("; ".join(errors))
    if origin is tuple:
        item, ellipsis = (typing.get_args(hint) + (None, None))[:2]
        if ellipsis is not Ellipsis:
            raise TypeError(f"{where}: only tuple[T, ...] fields are supported")  # internal
        if value is None or isinstance(value, dict):
            raise ValueError(
                f"{where}: expected a list of {_type_name(item)}, got {_describe(value)}"
            )
        if not isinstance(value, (list, tuple)):
            value = [value]  # a single item may be written without a list
        return tuple(_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_hint, item = typing.get_args(hint)
        if key_hint is not str:
            raise TypeError(f"{where}: only dict[str, T] fields are supported")  # internal
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {_describe(value)}")
        # keys as YAML read them: a bare 1 or true is refused rather than turned into "1"
        return {
            _coerce(str, k, f"{where} key {k!r}"): _coerce(item, v, f"{where}.{k}")
            for k, v in value.items()
        }
    if origin is Literal:
        choices = typing.get_args(hint)
        # `type(...) is` as well as `==`: True == 1 and 1 == 1.0 would otherwise pass for 1 or 1.0
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ValueError(f"{where}: expected one of {list(choices)}, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number (float), got {_describe(value)}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # internal: extend _coerce


_YAML_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


def _describe(value: Any) -> str:
    """``value`` as YAML would show it, and what YAML read it as."""
    if value is None:
        return "null"
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    kind = _YAML_KINDS.get(type(value), type(value).__name__)
    if isinstance(value, str) and _looks_numeric(value):
        return f"{shown} ({kind}: a quoted number is a string in YAML; write it without quotes)"
    return f"{shown} ({kind})"


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _type_name(hint: Any) -> str:
    return {str: "strings", int: "integers", float: "numbers", bool: "booleans"}.get(
        hint, repr(hint)
    )
