"""The output-folder lock: a second holder is refused naming the first, a killed holder
leaves no stale lock, and a restarted torchrun attempt takes the lock over from its job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

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


def test_a_lock_beside_a_folder_is_removed_on_release_and_refuses_meanwhile(tmp_path):
    out = tmp_path / "link" / "out"
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    lock = FolderLock.beside(out, "conversion").acquire()
    assert lock.path == tmp_path / "real" / ".out.lock" and not out.exists()
    # the same output through its real path is the same lock
    with pytest.raises(FolderLocked, match=rf"real/out is in use by .*PID {os.getpid()} "):
        FolderLock.beside(tmp_path / "real" / "out", "conversion").acquire()
    lock.release()
    assert list((tmp_path / "real").iterdir()) == []


def test_a_lock_file_removed_by_its_holder_before_the_flock_is_not_taken(tmp_path, monkeypatch):
    """A holder removes the file on release; a process that opened it just before, and locks it
    just after, must not count that lock (a third could create a new file and lock it too)."""
    from bapo_megatron.files import lock as lock_module

    flocks = []
    real_flock = lock_module.fcntl.flock

    def released_in_between(fd, operation):
        if not flocks:  # the first attempt: the holder releases between our open and flock
            os.unlink(tmp_path / ".out.lock")
        flocks.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(lock_module.fcntl, "flock", released_in_between)
    lock = FolderLock.beside(tmp_path / "out", "conversion").acquire()
    monkeypatch.undo()
    assert len(flocks) == 2  # the orphaned file was given up, the new one taken
    with pytest.raises(FolderLocked):
        FolderLock.beside(tmp_path / "out", "conversion").acquire()
    lock.release()
    assert list(tmp_path.iterdir()) == []


def _job_holder(folder, job):
    """A process holding ``folder``'s lock as a process of torchrun job ``job``."""
    script = HOLD.replace("'training run')", f"'training run', job={job!r})")
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "held\n"
    return process


def test_a_restarted_attempt_takes_the_lock_over_from_its_job_and_no_other(tmp_path, monkeypatch):
    """A dead attempt's process (job ``run-1``) may still be ending when the restarted one
    locks: that holder is waited for (bounded); a holder of another job is refused at once."""
    from bapo_megatron.files import lock as lock_module

    holder = _job_holder(tmp_path, "run-1")
    try:
        with pytest.raises(FolderLocked, match=r"training run\) \(still held after 0.2 s\)"):
            FolderLock(tmp_path, "training run", job="run-1").acquire(same_job_wait_s=0.2)
        refused = []
        other = threading.Thread(  # a wait of an hour would not end within the join below
            target=lambda: _refusal(refused, FolderLock(tmp_path, "run", job="run-2"))
        )
        other.start()
        other.join(timeout=60)
        assert not other.is_alive() and len(refused) == 1
        assert "(still held" not in str(refused[0])

        waiting, taken = threading.Event(), []
        real_sleep = time.sleep

        def sleep(seconds):
            waiting.set()
            real_sleep(seconds)

        monkeypatch.setattr(lock_module.time, "sleep", sleep)
        taker = threading.Thread(
            target=lambda: taken.append(
                FolderLock(tmp_path, "training run", job="run-1").acquire(same_job_wait_s=3600)
            )
        )
        taker.start()
        assert waiting.wait(timeout=60)  # it found the holder and waits for it
    finally:
        holder.stdin.close()
        holder.wait()
    taker.join(timeout=60)
    assert not taker.is_alive() and len(taken) == 1
    record = json.loads((tmp_path / ".bapo_megatron.lock").read_text())
    assert record["pid"] == os.getpid() and record["job"] == "run-1"
    taken[0].release()


def _refusal(found: list, lock: FolderLock) -> None:
    try:
        lock.acquire(same_job_wait_s=3600)
    except FolderLocked as error:
        found.append(error)
