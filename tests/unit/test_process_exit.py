"""A process that skips the final collection (bapo_megatron/train/process_exit.py) still ends
cleanly: its ``atexit`` handlers run, a file it left open is flushed as its module is torn down,
and the exit status is the one it asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.gloo_launch import REPO_ROOT


def test_exit_handlers_run_and_open_files_are_flushed(tmp_path):
    code = textwrap.dedent(
        f"""
        import atexit, gc, sys
        from bapo_megatron.train.process_exit import skip_final_collection
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
