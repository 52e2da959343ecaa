"""Outputs that appear whole or not at all.

A conversion writes into a hidden sibling of its destination, ``.<name>.incomplete``, and renames
it into place only after every rank has finished writing. A run that is killed leaves just that
hidden folder (removed by the next run to the same destination); a run that fails with an
exception removes it. Nothing at the destination ever looks complete before it is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist


def staging_path(final: Path) -> Path:
    """The hidden sibling folder a write to ``final`` goes to first."""
    return final.parent / f".{final.name}.incomplete"


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _is_first(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def check_output(final: str | Path, overwrite: bool = False) -> Path:
    """``final`` as an absolute path; ``ValueError`` if it exists (unless ``overwrite``) or its
    parent folder does not. Call it before long work, so that a bad output fails fast."""
    final = Path(final).absolute()
    if final.exists() and not overwrite:
        raise ValueError(
            f"output {final} already exists (overwrite=True, or --overwrite, replaces it)"
        )
    if not final.parent.is_dir():
        raise ValueError(f"output {final}: parent folder {final.parent} does not exist")
    return final


@contextlib.contextmanager
def staged_folder(
    final: str | Path, *, overwrite: bool = False, group: dist.ProcessGroup | None = None
) -> Iterator[Path]:
    """Yield an empty staging folder for ``final`` and rename it to ``final`` on success.

    Collective over ``group`` (default: the whole world, if torch.distributed is initialized):
    every rank enters, rank 0 of the group creates and renames, barriers order the steps, and all
    ranks must see the same filesystem. ``final`` must not exist unless ``overwrite`` (then the
    old folder is replaced only once the new one is complete). On an exception the staging
    folder is removed and the exception propagates.
    """
    final = check_output(final, overwrite)
    staging = staging_path(final)
    if _is_first(group):
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed run
        staging.mkdir()
    _barrier(group)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _barrier(group)
    if _is_first(group):
        if final.exists():
            old = final.parent / f".{final.name}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
    _barrier(group)


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file (0o666 less the process umask). Files written through
    ``tempfile.mkstemp`` start at 0o600; reports and plots get this mode before they are renamed
    into place, so other users can read them as they could any other output."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


@contextlib.contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """A hidden temporary file next to ``path`` for the block to write; when the block ends, the
    file gets the usual mode (:func:`new_file_mode`) and is renamed over ``path``, so readers see
    the old file or the new one, never a part; when the block raises, it is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8), synced, through :func:`replaced_atomically`."""
    with replaced_atomically(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
