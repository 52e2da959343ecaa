"""Every field of every configuration dataclass carries a docstring (the string literal right
after the field, which is where the documentation of a field lives in this project)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import textwrap

import bapo_megatron.config as config_package


def undocumented_fields(source: str) -> dict[str, dict[str, list[str]]]:
    """Per dataclass defined at the top level of ``source``: its annotated fields that are not
    followed by a non-empty string literal, and the names of all its annotated fields."""
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or not any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            continue
        fields, missing = [], []
        for index, statement in enumerate(node.body):
            if (
                not isinstance(statement, ast.AnnAssign)
                or not isinstance(statement.target, ast.Name)
                or "ClassVar" in ast.unparse(statement.annotation)
            ):  # not a dataclass field
                continue
            fields.append(statement.target.id)
            following = node.body[index + 1] if index + 1 < len(node.body) else None
            documented = (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
                and following.value.value.strip()
            )
            if not documented:
                missing.append(statement.target.id)
        found[node.name] = {"fields": fields, "missing": missing}
    return found


def test_every_config_field_has_a_docstring():
    found, runtime = {}, {}
    for info in pkgutil.iter_modules(config_package.__path__, config_package.__name__ + "."):
        module = importlib.import_module(info.name)
        found.update(undocumented_fields(inspect.getsource(module)))
        # the source walk sees exactly the dataclasses and fields Python sees, so none can hide
        runtime.update(
            {
                name: [f.name for f in dataclasses.fields(cls)]
                for name, cls in vars(module).items()
                if inspect.isclass(cls)
                and dataclasses.is_dataclass(cls)
                and cls.__module__ == module.__name__
            }
        )
    assert "Config" in runtime and "OptimizerConfig" in runtime
    assert {name: info["fields"] for name, info in found.items()} == runtime
    assert {name: info["missing"] for name, info in found.items() if info["missing"]} == {}


def test_the_walk_finds_an_undocumented_field():
    source = textwrap.dedent('''
        @dataclass(kw_only=True)
        class Section:
            documented: int = 1
            """What it is."""
            bare: float = 0.5
            blank: str = ""
            """ """
            last: bool = False
    ''')
    assert undocumented_fields(source) == {
        "Section": {
            "fields": ["documented", "bare", "blank", "last"],
            "missing": ["bare", "blank", "last"],
        }
    }
