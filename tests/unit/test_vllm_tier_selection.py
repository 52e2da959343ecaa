"""The vLLM tier's selection (tests/helpers/vllm_tier_plugin.py): every test of tests/vllm/ is
marked ``vllm``, and where vLLM is missing a test that would run in no tier fails instead of
skipping (pytest on small test files, in a fresh process with the plugin alone)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from tests.helpers import vllm_tier_plugin
from tests.helpers.gloo_launch import REPO_ROOT

STRAYS = '''
import importlib.util
import pytest

NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(NO_VLLM, reason="vllm is not installed")
def test_skips_for_vllm_unmarked():
    pass


@pytest.mark.vllm
def test_marked_outside_the_folder():
    pass


@pytest.mark.skipif(True, reason="needs a GPU")
def test_skips_for_another_reason():
    pass


def test_plain():
    pass
'''


def outcomes(tmp_path, *args: str) -> dict[str, str]:
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.helpers.vllm_tier_plugin", "--noconftest",
         "-p", "no:cacheprovider", "-q", f"--junitxml={report}", *args],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=600, check=False,
    )
    results = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        results[case.get("name")] = (
            "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
            else "passed"
        )
    return results


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_a_test_no_tier_would_run_fails(tmp_path):
    (tmp_path / "test_strays.py").write_text(STRAYS)
    assert outcomes(tmp_path, "test_strays.py") == {
        "test_skips_for_vllm_unmarked": "failed",
        "test_marked_outside_the_folder": "failed",
        "test_skips_for_another_reason": "skipped",
        "test_plain": "passed",
    }


def test_every_test_of_the_vllm_folder_is_marked():
    """The plugin marks what it collects under tests/vllm/ (and skips it where vLLM is
    missing); a test elsewhere keeps its own marks."""
    class Item:
        def __init__(self, path):
            self.path, self.marks = path, []

        def add_marker(self, mark):
            self.marks.append(getattr(mark, "mark", mark))

        def get_closest_marker(self, name):
            return next((m for m in self.marks if m.name == name), None)

    inside = Item(REPO_ROOT / "tests" / "vllm" / "test_anything.py")
    outside = Item(REPO_ROOT / "tests" / "unit" / "test_anything.py")
    vllm_tier_plugin.pytest_collection_modifyitems(None, [inside, outside])
    assert inside.get_closest_marker("vllm") is not None and outside.marks == []
    skipped = inside.get_closest_marker("skip")
    if importlib.util.find_spec("vllm") is None:
        assert skipped is not None and skipped.kwargs["reason"] == vllm_tier_plugin.SKIP_REASON
    else:
        assert skipped is None
