"""Load a :class:`bapo_megatron.config.Config` from YAML plus ``dotted.key=value`` overrides.

The YAML tree mirrors the dataclasses; override values are parsed as YAML scalars (``null``,
``3.0``, ``1e-3``, ``true``). A section with a ``preset`` key and a ``from_preset`` constructor
starts from that preset. Unknown keys and wrongly typed values raise ``ValueError`` naming the
dotted field and the expected type (:func:`~bapo_megatron.config.value_types.build_dataclass`):
a quoted ``'0.001'`` is a string and is refused where a number is expected, ``true`` is not a
number, and ``2.0`` is not an integer; an integer is accepted where a float is expected. A key
written twice in one mapping is refused with both lines (YAML would silently keep the last).
:func:`config_yaml` writes a built configuration back as the YAML that loads to it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bapo_megatron.config.run import Config
from bapo_megatron.config.value_types import build_dataclass

T = TypeVar("T")

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that exponent numbers without a dot (``1e-3``) are floats.

    PyYAML follows YAML 1.1, which reads ``1e-3`` as a string; YAML 1.2 and most people read it
    as a number. Resolving it here is what lets the loader refuse every string where a number is
    expected, so that a quoted ``'0.001'`` is an error rather than silently a number."""


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str, where: str) -> Any:
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, where, "", set())
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML ({err})") from None
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: yaml.Node, where: str, path: str, seen: set[int]) -> None:
    """Raise ``ValueError`` naming ``where``, the dotted key and both lines when a mapping in the
    tree under ``node`` has the same key twice (PyYAML keeps the last one without a word)."""
    if id(node) in seen:  # an alias of a node already walked (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            dotted = f"{path}.{key}" if path else str(key)
            if key is not None:
                if (key_node.tag, key) in lines:
                    raise ValueError(
                        f"{where}: key {dotted!r} is written twice, on lines "
                        f"{lines[(key_node.tag, key)]} and {line} (YAML would silently keep the "
                        "last); keep one"
                    )
                lines[(key_node.tag, key)] = line
            _refuse_duplicate_keys(value_node, where, dotted, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, where, f"{path}[{index}]", seen)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    cls: type[T] = Config,
) -> T:
    """Build ``cls`` from the YAML file at ``path`` (optional) with ``overrides`` applied on top."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        loaded = _parse_yaml(path.read_text(encoding="utf-8"), f"config file {path}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(
                f"config file {path}: expected a mapping at the top level, "
                f"got {type(loaded).__name__}"
            )
        tree = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected dotted.key=value")
        value = _parse_yaml(raw, f"override {item!r}") if raw.strip() else ""
        _set_dotted(tree, key.strip(), value)
    return build_dataclass(cls, tree, prefix="")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(  # noqa: TRY004 - every config error is a ValueError
                f"override {dotted}: {'.'.join(parts[: i + 1])} is a value, not a section"
            )
        node = child
    node[parts[-1]] = value


def config_yaml(config: Any) -> str:
    """Every field of the configuration dataclass ``config``, sections nested, in the order the
    dataclasses define them, as YAML that :func:`load_config` builds back to an equal one."""
    return yaml.safe_dump(_tree(config), sort_keys=False, allow_unicode=True, width=100)


def _tree(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _tree(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_tree(item) for item in value]
    if isinstance(value, dict):
        return {key: _tree(item) for key, item in value.items()}
    return value
