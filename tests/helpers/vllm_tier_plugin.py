"""How the suite keeps vLLM's tests in the vLLM tier. The tier (.ci/vllm-tier) runs the folder
tests/vllm/, whose tests are all marked ``vllm``; the real-model tier runs the ``vllm`` tests of
tests/real_model/ the same way. Where vLLM is missing those tests are skipped, and a test fails
that would otherwise run in no tier: one marked ``vllm`` outside those folders, or one that
skips for a missing vLLM without the marker."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SKIP_REASON = "needs vLLM: the vLLM tier runs it (.ci/vllm-tier)"
TESTS = Path(__file__).resolve().parents[1]
VLLM_FOLDERS = (TESTS / "vllm", TESTS / "real_model")
"""The folders whose ``vllm`` tests a tier runs."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def in_vllm_folder(path: Path) -> bool:
    return any(folder in Path(path).resolve().parents for folder in VLLM_FOLDERS)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers added here
def pytest_collection_modifyitems(config, items):
    skip = None if vllm_installed() else pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if (TESTS / "vllm") in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.vllm)
        if item.get_closest_marker("vllm") and skip is not None:
            item.add_marker(skip)


def skip_reason(report) -> str:
    """The reason pytest recorded for a skipped test ("" when it has none)."""
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""


def outside_every_tier(item, report) -> str | None:
    """Why ``item`` would run in no tier, or None."""
    marked = item.get_closest_marker("vllm") is not None
    if marked and not in_vllm_folder(item.path):
        return (
            f"{item.nodeid} is marked `vllm` outside tests/vllm/, the folder the vLLM tier "
            "runs: move it there"
        )
    reason = skip_reason(report)
    if report.skipped and not marked and "vllm" in reason.lower() and not vllm_installed():
        return (
            f"{item.nodeid} skips where vLLM is missing ({reason!r}) but no tier runs it: "
            "put it in tests/vllm/"
        )
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.skipped):
        why = outside_every_tier(item, report)
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why
