"""The install files agree: every exact pin lies in the ranges pyproject.toml declares, the vLLM
tier pins what it takes from requirements.txt at requirements.txt's versions, the GPU stack
shares the CPU stack's versions except where vLLM caps one, and docs/install.md's table gives
the GPU stack's pins (which file describes which install: docs/install.md)."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.gloo_launch import REPO_ROOT

# Where the GPU stack (constraints-gpu.txt) parts from the CPU stack (requirements.txt), and why.
GPU_STACK_DIFFERS = {"transformers": "vLLM 0.32.0 admits >= 5.16.1, < 5.20"}
# docs/install.md's names for the GPU stack's packages.
INSTALL_TABLE_NAMES = {
    "vLLM": "vllm",
    "torch": "torch",
    "megatron-core": "megatron-core",
    "transformers": "transformers",
    "Transformer Engine": "transformer-engine",
}


def pins(name: str) -> dict[str, str]:
    """The ``package==version`` lines of the requirements or constraints file ``name``."""
    found = {}
    for line in (REPO_ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{name}: {line!r} is not an exact pin"
        found[canonicalize_name(requirement.name)] = spec.version
    return found


def declared_ranges() -> dict[str, Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(line) for line in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in declared}


@pytest.mark.parametrize(
    "name", ["requirements.txt", "constraints-gpu.txt", "requirements-vllm.txt"]
)
def test_every_pin_lies_in_the_declared_ranges(name):
    ranges = declared_ranges()
    outside = [
        f"{package}=={version} not in {ranges[package].specifier}"
        for package, version in pins(name).items()
        if package in ranges and not ranges[package].specifier.contains(version)
    ]
    assert outside == [], f"{name}: {outside}"


def test_the_vllm_tier_pins_what_it_shares_with_the_cpu_stack_at_its_versions():
    cpu = pins("requirements.txt")
    shared = {p: v for p, v in pins("requirements-vllm.txt").items() if p in cpu}
    assert shared and shared == {p: cpu[p] for p in shared}


def test_the_gpu_stack_differs_from_the_cpu_stack_only_where_vllm_caps_it():
    cpu, gpu = pins("requirements.txt"), pins("constraints-gpu.txt")
    differs = {p for p in gpu if p in cpu and gpu[p] != cpu[p]}
    assert differs == set(GPU_STACK_DIFFERS)


def test_the_install_page_gives_the_gpu_stack_pins():
    gpu = pins("constraints-gpu.txt")
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    table = dict(re.findall(r"^\| ([^|]+?) \| ([0-9][^ |]*)", text, re.MULTILINE))
    assert {INSTALL_TABLE_NAMES[n]: v for n, v in table.items() if n in INSTALL_TABLE_NAMES} == gpu
