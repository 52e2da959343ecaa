"""An exclusive lock on an output folder, so two runs never write into one folder at once.

Two trainers started in the same ``train.output_dir`` mix their records and checkpoints (one's
``metrics.jsonl`` beside the other's checkpoints), and two conversions into one folder mix their
shards. The lock is ``flock`` on a file in the folder, which the kernel releases when its
holder ends, however it ends (SIGKILL included): a crashed run never leaves a stale lock. The
file names the holder (PID and host) so that the refusal can say who it is.

A torchrun job that restarts its workers in place locks the folder again from a new process
while the dead attempt's processes may still be ending: a lock tagged with the job's id
(``job``) waits, bounded, for a holder of the same job to go, and refuses any other at once.

An output that is written aside and renamed into place (a conversion's,
:func:`~bapo_megatron.files.atomic.staged_folder`) cannot hold its own lock file: the folder is
replaced. :meth:`FolderLock.beside` locks a hidden file next to it instead, which its holder
removes on release, so that nothing is left beside the output.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".bapo_megatron.lock"


class FolderLocked(RuntimeError):
    """Another process holds the folder's lock."""


class FolderLock:
    """``with FolderLock(folder, purpose):`` holds ``folder``'s lock (creating the folder) or
    raises :class:`FolderLocked` naming the holder. Also :meth:`acquire` / :meth:`release`.
    ``job``: the id of the job this process belongs to (a torchrun run id), written beside the
    PID; :meth:`acquire` waits for a holder of the same job."""

    def __init__(self, folder: str | Path, purpose: str, *, job: str | None = None) -> None:
        self.folder, self.purpose, self.job = Path(folder), purpose, job
        self.path = self.folder / LOCK_FILE
        """The lock file."""
        self._remove_on_release = False
        self._fd: int | None = None

    @classmethod
    def beside(cls, folder: str | Path, purpose: str) -> FolderLock:
        """The lock of ``folder`` held on ``.<name>.lock`` in its parent (symlinks resolved), for
        a folder that is replaced as a whole; the folder need not exist, the parent is created.
        The file is removed on release."""
        lock = cls(folder, purpose)
        parent = lock.folder.absolute().parent.resolve()
        lock.path, lock._remove_on_release = parent / f".{lock.folder.name}.lock", True
        return lock

    def acquire(self, *, same_job_wait_s: float = 0.0) -> FolderLock:
        """Take the lock; a holder of this lock's ``job`` (an earlier attempt of the job, ending)
        is waited for up to ``same_job_wait_s``, any other refused at once."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + same_job_wait_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                same_job = self.job is not None and holder.get("job") == self.job
                if same_job and time.monotonic() < deadline:
                    time.sleep(0.05)  # the holder's end releases the lock: try again
                    continue
                still = f" (still held after {same_job_wait_s:g} s)" if same_job else ""
                raise FolderLocked(
                    f"{self.folder} is in use by another process ({_describe(holder)}){still}; "
                    f"give this {self.purpose} another folder, or wait for that one to end"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _is_file_at(fd, self.path):
                break
            # A holder removed the file (on release) between our open and our flock: the lock
            # we got is on a file no one else will open. Take the one now at the path.
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "purpose": self.purpose,
                    "job": self.job,
                }
            ).encode(),
            0,
        )
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            if self._remove_on_release:  # while still held: see acquire
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _is_file_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the one ``path`` names now."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino)


def _read_holder(fd: int) -> dict:
    """What the lock file says of its holder (``{}`` while it is being written)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    """``PID N on host H, purpose`` from the lock file's record, or what is known of it."""
    try:
        return f"PID {holder['pid']} on host {holder['host']}, {holder['purpose']}"
    except KeyError:
        return "holder unknown: its lock file is being written"
