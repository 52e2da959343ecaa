"""An exclusive lock on an output folder, so two runs never write into one folder at once.

Two trainers started in the same ``train.output_dir`` mix their records and checkpoints (one's
``metrics.jsonl`` beside the other's checkpoints), and two conversions into one folder mix their
shards. The lock is ``flock`` on a file in the folder, which the kernel releases when its
holder ends, however it ends (SIGKILL included): a crashed run never leaves a stale lock. The
file names the holder (PID and host) so that the refusal can say who it is.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = ".bapo_megatron.lock"


class FolderLocked(RuntimeError):
    """Another process holds the folder's lock."""


class FolderLock:
    """``with FolderLock(folder, purpose):`` holds ``folder``'s lock (creating the folder) or
    raises :class:`FolderLocked` naming the holder. Also :meth:`acquire` / :meth:`release`."""

    def __init__(self, folder: str | Path, purpose: str) -> None:
        self.folder, self.purpose = Path(folder), purpose
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise FolderLocked(
                f"{self.folder} is in use by another process ({holder}); give this "
                f"{self.purpose} another folder, or wait for that one to end"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose}
            ).encode(),
            0,
        )
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """``PID N on host H (purpose)`` from the lock file, or what is known of it."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"PID {holder['pid']} on host {holder['host']}, {holder['purpose']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: its lock file is being written"
