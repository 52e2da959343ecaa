"""The output-folder lock: a second holder is refused naming the first, and a killed holder
leaves no stale lock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from bapo_megatron.files.lock import FolderLock, FolderLocked

HOLD = (
    "import sys, time\n"
    "from bapo_megatron.files.lock import FolderLock\n"
    "FolderLock(sys.argv[1], 'training run').acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)  # holds until its stdin closes or it is killed


def _holder(folder):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "held\n"
    return process


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    folder = tmp_path / "run"
    holder = _holder(folder)
    try:
        with pytest.raises(FolderLocked) as refused:
            FolderLock(folder, "conversion").acquire()
        assert str(refused.value) == (
            f"{folder} is in use by another process (PID {holder.pid} on host "
            f"{socket.gethostname()}, training run); give this conversion another folder, or wait "
            "for that one to end"
        )
    finally:
        holder.stdin.close()
        holder.wait()
    with FolderLock(folder, "conversion"):  # released when the holder ended
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock = FolderLock(tmp_path, "training run").acquire()
    with pytest.raises(FolderLocked, match=f"PID {os.getpid()} "):  # one process, two locks
        FolderLock(tmp_path, "training run").acquire()
    lock.release()
    FolderLock(tmp_path, "training run").acquire().release()
