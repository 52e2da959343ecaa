"""Load a :class:`bapo_megatron.config.Config` from YAML plus ``dotted.key=value`` overrides.

The YAML tree mirrors the dataclasses; override values are parsed as YAML scalars (``null``,
``3.0``, ``true``). A section with a ``preset`` key and a ``from_preset`` constructor starts from
that preset. Unknown keys and wrongly typed values raise ``ValueError`` naming the dotted field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from bapo_megatron.config import Config

T = TypeVar("T")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                cls: type[T] = Config) -> T:
    """Build ``cls`` from the YAML file at ``path`` (optional) with ``overrides`` applied on top."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        with path.open() as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}")
        tree = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected dotted.key=value")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return build_dataclass(cls, tree, prefix="")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {dotted}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_dataclass(cls: type[T], data: Any, prefix: str) -> T:
    """Instantiate dataclass ``cls`` from a mapping, checking keys and value types recursively."""
    where = prefix or "<root>"
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; {cls.__name__} has {sorted(fields)}")
    kwargs = {name: _coerce(hints[name], value, _join(prefix, name)) for name, value in data.items()}
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
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            value = [value]  # a single item may be written without a list
        return tuple(_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ValueError(f"{where}: expected one of {list(choices)}, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads exponent-only numbers such as 1e-6 as strings.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # internal: extend _coerce
