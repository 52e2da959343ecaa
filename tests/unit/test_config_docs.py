"""Every field of every configuration dataclass carries a docstring (the string literal right
after the field, which is where the documentation of a field lives in this project), and the
reference page made from them, docs/config.md, is current."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import textwrap
import typing

import bapo_megatron.config as config_package
from bapo_megatron.config import reference
from bapo_megatron.config.reference import config_reference, field_docstrings
from tests.helpers.gloo_launch import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "config.md"


def undocumented_fields(source: str) -> dict[str, dict[str, list[str]]]:
    """Per dataclass defined at the top level of ``source``: its annotated fields that are not
    followed by a non-empty string literal, and the names of all its annotated fields."""
    return {
        name: {"fields": list(docs), "missing": [f for f, doc in docs.items() if doc is None]}
        for name, docs in field_docstrings(source).items()
    }


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


def test_the_reference_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == config_reference(), (
        "docs/config.md is out of date: run python tools/config_reference.py"
    )


def test_the_reference_page_follows_a_changed_field_docstring(monkeypatch):
    read = reference.class_field_docstrings

    def edited(cls):
        docs = read(cls)
        if cls.__name__ == "TrainConfig":
            docs["steps"] = "An edited description of the field."
        return docs

    monkeypatch.setattr(reference, "class_field_docstrings", edited)
    page = config_reference()
    assert page != PAGE.read_text(encoding="utf-8")
    assert "- `steps` (`int`; default " in page
    assert "An edited description of the field." in page


def test_the_reference_page_lists_every_field_under_its_section():
    blocks = {}
    for block in config_reference().split("\n## ")[1:]:
        heading, _, body = block.partition("\n")
        blocks[heading] = [line.split("`")[1] for line in body.splitlines() if line[:3] == "- `"]
    expected = {}

    def walk(cls, path):
        expected[f"`{path}` ({cls.__name__})" if path else "The root (Config)"] = [
            f.name for f in dataclasses.fields(cls)
        ]
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            section = reference._section_class(hints[field.name])
            if section is not None:
                walk(section, f"{path}.{field.name}" if path else field.name)

    walk(config_package.Config, "")
    assert blocks == expected
    assert "model.moe" in "".join(blocks) and "logging.wandb" in "".join(blocks)
