"""The configuration's field documentation, read where it is written, and the reference page
made from it (``docs/config.md``, written by ``tools/config_reference.py``).

A field is documented by the string literal right after it in its dataclass, the one place its
meaning is written; :func:`field_docstrings` reads those from a module's source (Python keeps
them nowhere at run time). :func:`config_reference` walks :class:`~bapo_megatron.config.Config`
section by section, in the order the dataclasses define their fields, with each field's type and
default as the loader reads them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import types
import typing
from typing import Any, Literal

import yaml

from bapo_megatron.config.run import Config

PAGE_INTRO = """\
# Configuration reference

Every field of a run's YAML configuration, section by section: its type, its default and what it
means. A run reads `python -m bapo_megatron.train --config FILE.yaml [dotted.key=value ...]`
(`bapo-train`); `--print-config` prints the configuration a file and its overrides resolve to,
as YAML, and exits. A section written as `null` (or left out, where its default is null) is
absent.

This page is generated from the field docstrings in `bapo_megatron/config/` by
`python tools/config_reference.py`; `tests/unit/test_config_docs.py` fails when it is out of
date.
"""


def field_docstrings(source: str) -> dict[str, dict[str, str | None]]:
    """Per dataclass defined at the top level of ``source``: its annotated fields in order, each
    with the string literal right after it (None where there is none, or it is blank)."""
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or not any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            continue
        fields: dict[str, str | None] = {}
        for index, statement in enumerate(node.body):
            if (
                not isinstance(statement, ast.AnnAssign)
                or not isinstance(statement.target, ast.Name)
                or "ClassVar" in ast.unparse(statement.annotation)
            ):  # not a dataclass field
                continue
            following = node.body[index + 1] if index + 1 < len(node.body) else None
            doc = None
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
                and following.value.value.strip()
            ):
                doc = inspect.cleandoc(following.value.value)
            fields[statement.target.id] = doc
        found[node.name] = fields
    return found


def class_field_docstrings(cls: type) -> dict[str, str | None]:
    """:func:`field_docstrings` of the dataclass ``cls``, from its module's source."""
    return field_docstrings(inspect.getsource(sys.modules[cls.__module__]))[cls.__name__]


def config_reference() -> str:
    """The reference page: :data:`PAGE_INTRO`, then one part per section of
    :class:`~bapo_megatron.config.Config`, depth first."""
    parts = [PAGE_INTRO]
    _section(Config, "", None, parts)
    return "\n".join(parts)


def _section(cls: type, path: str, doc: str | None, parts: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    docs = class_field_docstrings(cls)
    title = f"`{path}`" if path else "The root"
    lines = [f"## {title} ({cls.__name__})", ""]
    if doc:
        lines += [_markdown(doc), ""]
    if cls.__doc__:
        lines += [_markdown(inspect.cleandoc(cls.__doc__)), ""]
    subsections = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        hint = hints[field.name]
        dotted = f"{path}.{field.name}" if path else field.name
        section = _section_class(hint)
        if section is not None:
            subsections.append((section, dotted, docs.get(field.name)))
            lines.append(
                f"- `{field.name}` ({_type_text(hint)}): [`{dotted}`](#{_anchor(dotted, section)})"
            )
            continue
        lines.append(
            f"- `{field.name}` ({_type_text(hint)}; {_default_text(field)}): "
            + _markdown(docs.get(field.name) or "").replace("\n\n", "\n\n  ")
        )
    parts.append("\n".join(lines) + "\n")
    for section, dotted, field_doc in subsections:
        _section(section, dotted, field_doc, parts)


def _section_class(hint: Any) -> type | None:
    """The dataclass a field of type ``hint`` holds (``Section`` or ``Section | None``)."""
    candidates = [hint, *typing.get_args(hint)]
    found = [c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return found[0] if found else None


def _anchor(dotted: str, cls: type) -> str:
    """GitHub's anchor of a section's heading."""
    heading = f"{dotted} ({cls.__name__})".lower()
    return re.sub(r"[^a-z0-9 _-]", "", heading).replace(" ", "-")


def _type_text(hint: Any) -> str:
    return f"`{_type_name(hint)}`"


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(option) for option in typing.get_args(hint))
    if origin is Literal:
        return " | ".join(_yaml_scalar(choice) for choice in typing.get_args(hint))
    if origin is tuple:
        return f"list[{_type_name(typing.get_args(hint)[0])}]"
    if origin is dict:
        key, item = typing.get_args(hint)
        return f"mapping[{_type_name(key)}, {_type_name(item)}]"
    if dataclasses.is_dataclass(hint):
        return "section"
    return hint.__name__


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"default `{_yaml_scalar(field.default)}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"default `{_yaml_scalar(field.default_factory())}`"
    return "required"


def _yaml_scalar(value: Any) -> str:
    """``value`` as it is written in a config file (flow style for lists and mappings)."""
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def _markdown(text: str) -> str:
    """A docstring as Markdown: paragraphs joined into lines, Sphinx roles as code."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"``\1``", text)
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
