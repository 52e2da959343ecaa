"""A process forked by the trainer (as Megatron's checkpoint writer forks its write workers)
ends when the trainer is killed, instead of blocking for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import multiprocessing, os, signal, sys, time
from bapo_megatron.megatron_patches.child_processes import forked_writers_end_with_us
{install}
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,))
child.start()
print(child.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def _orphan_survives(install: bool, wait_s: float) -> bool:
    """Whether the forked child is still running ``wait_s`` after its parent was killed."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SCRIPT.format(install="forked_writers_end_with_us()" if install else ""),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    parent.stdin.close()
    parent.stdout.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    return True


def test_forked_children_end_with_the_process_that_forked_them():
    assert not _orphan_survives(install=True, wait_s=30)


def test_without_the_hook_a_forked_child_outlives_its_parent():
    # the condition the hook exists for (and proof that the test above can fail)
    assert _orphan_survives(install=False, wait_s=1)
