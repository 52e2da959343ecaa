"""A process that skips the final collection (bapo_megatron/process/end.py) still ends
cleanly: its ``atexit`` handlers run, a file it left open is flushed as its module is torn down,
and the exit status is the one it asked for. ``python -m bapo_megatron.train`` ends as
``bapo-train`` does: it is the same function (what that function calls:
tests/unit/test_deferred_imports.py)."""

from __future__ import annotations

import runpy
import subprocess
import sys
import textwrap
import tomllib

from bapo_megatron.commands import console
from tests.helpers.gloo_launch import REPO_ROOT


def test_python_m_train_runs_the_console_script_function(monkeypatch):
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["bapo-train"] == "bapo_megatron.commands.console:train"
    calls = []
    monkeypatch.setattr(console, "train", lambda: calls.append("train"))
    runpy.run_module("bapo_megatron.train", run_name="__main__")
    assert calls == ["train"]


def test_exit_handlers_run_and_open_files_are_flushed(tmp_path):
    code = textwrap.dedent(
        f"""
        import atexit, gc, sys
        from bapo_megatron.process.end import skip_final_collection
        left_open = open({str(tmp_path / "open.txt")!r}, "w")
        left_open.write("written, never closed")
        atexit.register(lambda: open({str(tmp_path / "atexit.txt")!r}, "w").write("ran"))
        cycle = [[]]
        cycle[0].append(cycle)
        skip_final_collection()
        assert gc.get_freeze_count() > 0
        sys.exit(3)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "open.txt").read_text() == "written, never closed"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
