"""A folder's manifest: the size and SHA-256 of every file in it, written when the folder is
complete and checked before it is trusted.

A checkpoint truncated by a full disk, or damaged later, fails deep inside the reader that
meets it (``EOFError`` in a ``.distcp`` shard, a bare ``JSONDecodeError``) without naming the
file. Checked against its manifest, the same damage is found before anything is read, and is
named: which file, and how it differs. Hashing is split over ranks by the caller (each hashes
its share of the files, :func:`share_of`), since a large run's checkpoint is hundreds of GB.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_FILE = "manifest.json"
_CHUNK = 4 * 2**20


class DamagedFolder(ValueError):
    """A folder that does not match its manifest (or has none)."""


def folder_files(folder: str | Path) -> list[str]:
    """Every file below ``folder`` (relative POSIX paths, sorted), the manifest itself excepted."""
    folder = Path(folder)
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = (Path(root) / name).relative_to(folder).as_posix()
            if relative != MANIFEST_FILE:
                found.append(relative)
    return sorted(found)


def share_of(files: list[str], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` of ``world_size`` hashes (every file by exactly one rank)."""
    return files[rank::world_size]


def file_digest(path: Path) -> dict[str, int | str]:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def digests(folder: str | Path, files: list[str]) -> dict[str, dict[str, int | str]]:
    """Digests of ``files`` (relative to ``folder``)."""
    return {name: file_digest(Path(folder) / name) for name in files}


def write_manifest(folder: str | Path, entries: dict[str, dict[str, int | str]]) -> None:
    """Write the manifest of ``folder`` from every file's digest (the folder is not yet in its
    final place: it is renamed there after this, so no separate atomic write is needed)."""
    missing = sorted(set(folder_files(folder)) - set(entries))
    if missing:
        raise ValueError(f"{folder}: no digest for {missing}")
    text = json.dumps({"files": dict(sorted(entries.items()))}, indent=1)
    (Path(folder) / MANIFEST_FILE).write_text(text + "\n")


def read_manifest(folder: str | Path) -> dict[str, dict[str, int | str]]:
    """The manifest's entries; :class:`DamagedFolder` naming the file if it is missing or not a
    manifest."""
    path = Path(folder) / MANIFEST_FILE
    try:
        entries = json.loads(path.read_text())["files"]
        if not all(isinstance(e, dict) and {"size", "sha256"} <= set(e) for e in entries.values()):
            raise ValueError("an entry lacks size or sha256")
    except FileNotFoundError:
        raise DamagedFolder(
            f"{path} is missing (a folder written before manifests existed, or "
            "one whose writing did not finish)"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedFolder(f"{path} is not a manifest ({type(err).__name__}: {err})") from None
    return entries


def check_listing(folder: str | Path, entries: dict[str, dict[str, int | str]]) -> None:
    """Cheap checks, no hashing: every listed file exists with its size, and no file was added."""
    folder = Path(folder)
    present = set(folder_files(folder))
    for name, entry in entries.items():
        if name not in present:
            raise DamagedFolder(f"{folder / name} is missing (listed in {MANIFEST_FILE})")
        size = (folder / name).stat().st_size
        if size != entry["size"]:
            raise DamagedFolder(
                f"{folder / name} is {size} bytes, {entry['size']} when written "
                "(truncated or overwritten)"
            )
    extra = sorted(present - set(entries))
    if extra:
        raise DamagedFolder(f"{folder}: files not in its {MANIFEST_FILE}: {extra}")


def check_digests(
    folder: str | Path, entries: dict[str, dict[str, int | str]], files: list[str]
) -> None:
    """Hash ``files`` (a rank's share) and compare with ``entries``."""
    for name in files:
        found = file_digest(Path(folder) / name)
        if found["sha256"] != entries[name]["sha256"]:
            raise DamagedFolder(
                f"{Path(folder) / name}: its contents changed since it was written "
                f"(SHA-256 {found['sha256'][:12]}..., "
                f"{str(entries[name]['sha256'])[:12]}... when written)"
            )
