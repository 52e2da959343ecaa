"""Packages the lent GPU machine lacks, carried to it in parts (docs/gpu-checks.md).

One transfer to that machine carries at most 64 MiB, the checkout included, and it has no
network. So a set of files (Transformer Engine's wheels, vLLM's) is bundled on a machine with
pip into one uncompressed tar (the wheels are compressed already), split into parts of at most
:data:`PART_BYTES`, each in a folder of its own with the set's manifest (every part's and every
file's SHA-256). On the GPU machine one command per part copies that part out of the checkout
(:func:`stash_part`), and the command that brings the last one joins them (:func:`join_parts`),
checking every digest, before anything is installed.

Standard library only: the GPU side runs it before anything is installed.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

PART_BYTES = 50 * 2**20
"""Largest part: 50 MiB, so that a part, the checkout (~8 MiB) and the small wheels fit one
transfer of 64 MiB."""
MANIFEST = "manifest.json"
"""The set's manifest, in every part's folder."""


class CarryError(RuntimeError):
    """A part or file is missing or does not match its SHA-256; the message says which."""


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of the file ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while block := source.read(2**20):
            digest.update(block)
    return digest.hexdigest()


def part_folder(out_root: Path, name: str, index: int) -> Path:
    """The folder of part ``index`` (1-based) of set ``name``: ``out_root/name-index``."""
    return out_root / f"{name}-{index}"


def bundle_and_split(
    name: str, files: Sequence[Path], out_root: Path, part_bytes: int = PART_BYTES
) -> list[Path]:
    """Bundle ``files`` (stored under their base names) into ``name.tar`` and split it into
    parts of at most ``part_bytes``, part k in ``out_root/name-k/`` beside its ``.sha256`` file
    and the manifest. Folders of an earlier split of the set are removed first. Returns the
    part folders in order."""
    names = [Path(f).name for f in files]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"set {name!r}: give one or more files with distinct names, got {names}")
    for old in out_root.glob(f"{name}-*"):
        if old.is_dir() and old.name[len(name) + 1 :].isdigit():
            shutil.rmtree(old)
    out_root.mkdir(parents=True, exist_ok=True)
    bundle = out_root / f"{name}.tar"
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            tar.add(path, arcname=Path(path).name, recursive=False)
    manifest = {
        "set": name,
        "bundle": bundle.name,
        "bundle_sha256": sha256_of(bundle),
        "bundle_bytes": bundle.stat().st_size,
        "files": [
            {"name": Path(f).name, "sha256": sha256_of(Path(f)), "bytes": Path(f).stat().st_size}
            for f in files
        ],
        "parts": [],
    }
    folders = []
    with open(bundle, "rb") as source:
        while block := source.read(part_bytes):
            index = len(folders) + 1
            folder = part_folder(out_root, name, index)
            folder.mkdir()
            part = folder / f"{bundle.name}.{index:02d}"
            part.write_bytes(block)
            digest = hashlib.sha256(block).hexdigest()
            (folder / f"{part.name}.sha256").write_text(f"{digest}  {part.name}\n")
            manifest["parts"].append({"file": part.name, "sha256": digest, "bytes": len(block)})
            folders.append(folder)
    bundle.unlink()
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return folders


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise CarryError(f"{folder}: no {MANIFEST} (not a part folder of a carried set)")
    return json.loads(path.read_text())


def stash_part(folder: Path, parts_root: Path) -> str:
    """Copy the part in ``folder`` (a carried part folder) and the manifest to
    ``parts_root/<set>/``, after checking the part's SHA-256; returns a line saying which
    parts of the set are there and which are still missing."""
    manifest = _read_manifest(folder)
    known = {p["file"]: p for p in manifest["parts"]}
    here = [p for p in folder.iterdir() if p.name in known]
    if len(here) != 1:
        raise CarryError(f"{folder}: expected one part of set {manifest['set']!r}, found {here}")
    part = here[0]
    if sha256_of(part) != known[part.name]["sha256"]:
        raise CarryError(f"{part}: SHA-256 differs from the manifest's (damaged in transfer)")
    target = parts_root / manifest["set"]
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(part, target / f"{part.name}.partial")
    (target / f"{part.name}.partial").replace(target / part.name)
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
    have = sorted(p["file"] for p in manifest["parts"] if (target / p["file"]).is_file())
    missing = sorted(set(known) - set(have))
    return (
        f"set {manifest['set']!r}: stashed {part.name} in {target}; have {len(have)} of "
        f"{len(known)} parts" + (f", missing {missing}" if missing else ", complete")
    )


def join_parts(set_dir: Path, out_dir: Path) -> list[Path]:
    """Check every part in ``set_dir`` (a stashed set) against the manifest, join them, check
    the bundle's SHA-256, unpack it into ``out_dir`` and check every file's; returns the
    files. ``CarryError`` names the parts to send again, or the file that does not match."""
    manifest = _read_manifest(set_dir)
    missing = [p["file"] for p in manifest["parts"] if not (set_dir / p["file"]).is_file()]
    if missing:
        raise CarryError(
            f"set {manifest['set']!r}: parts {missing} are not in {set_dir} (a restarted "
            "machine loses them: send them again, back to back)"
        )
    bad = [p["file"] for p in manifest["parts"] if sha256_of(set_dir / p["file"]) != p["sha256"]]
    if bad:
        raise CarryError(f"set {manifest['set']!r}: parts {bad} do not match their SHA-256")
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle = out_dir / manifest["bundle"]
    with open(bundle, "wb") as sink:
        for part in manifest["parts"]:
            with open(set_dir / part["file"], "rb") as source:
                shutil.copyfileobj(source, sink, 2**20)
    if sha256_of(bundle) != manifest["bundle_sha256"]:
        raise CarryError(f"{bundle}: the joined parts do not match the bundle's SHA-256")
    with tarfile.open(bundle) as tar:
        tar.extractall(out_dir, filter="data")
    bundle.unlink()
    files = []
    for entry in manifest["files"]:
        path = out_dir / entry["name"]
        if not path.is_file() or sha256_of(path) != entry["sha256"]:
            raise CarryError(f"{path}: missing or not matching its SHA-256 after unpacking")
        files.append(path)
    return files


def slim_wheel(wheel: Path, out: Path, drop: Callable[[str], bool]) -> list[str]:
    """Write ``wheel`` to ``out`` without the members ``drop`` selects, and with their lines
    removed from the wheel's ``RECORD`` (pip checks every file it installs against it, and a
    listed file that is absent is no error). Returns the dropped member names."""
    with zipfile.ZipFile(wheel) as source:
        infos = source.infolist()
        records = [i for i in infos if i.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise ValueError(f"{wheel}: expected one .dist-info/RECORD, found {len(records)}")
        dropped = [i.filename for i in infos if i not in records and drop(i.filename)]
        gone = set(dropped)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as sink:
            for info in infos:
                if info.filename in gone or info is records[0]:
                    continue
                with source.open(info) as member, sink.open(_copied(info), "w") as target:
                    shutil.copyfileobj(member, target, 2**20)
            rows = csv.reader(io.StringIO(source.read(records[0]).decode()))
            kept = io.StringIO()
            csv.writer(kept, lineterminator="\n").writerows(
                row for row in rows if row and row[0] not in gone
            )
            sink.writestr(_copied(records[0]), kept.getvalue())
    return dropped


def _copied(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    """A fresh entry for ``info``'s member (name, time, permissions; deflated), so that writing
    it does not touch the entry the source archive reads from."""
    entry = zipfile.ZipInfo(info.filename, info.date_time)
    entry.compress_type = zipfile.ZIP_DEFLATED
    entry.external_attr, entry.create_system = info.external_attr, info.create_system
    entry.file_size = info.file_size  # decides whether the member needs zip64 fields
    return entry
