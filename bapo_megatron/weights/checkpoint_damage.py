"""Which files of a damaged Megatron checkpoint (torch_dist) are at fault.

Megatron's and torch's readers fail on a damaged file without naming it: a truncated ``.distcp``
shard gives ``CheckpointException ... EOFError``, a garbled ``metadata.json`` a bare
``JSONDecodeError``, a truncated ``common.pt`` ``PytorchStreamReader failed``. When a load fails,
:func:`find_damage` looks at each of the checkpoint's files on its own, without unpickling
anything but the storage index (through the safe reader of
:mod:`~bapo_megatron.megatron_patches.checkpoint_metadata`):

- ``metadata.json`` (Megatron's checkpoint config) must be a JSON object;
- ``.metadata`` (torch's index) must read; it lists the file, offset and length of every item,
  so each file it names must exist and be at least as long as the furthest item it holds;
- ``common.pt`` (a zip archive, as ``torch.save`` writes) must pass the archive's checksums.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from bapo_megatron.megatron_patches.checkpoint_metadata import METADATA_FILE, check_metadata

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"


def find_damage(folder: str | Path) -> list[str]:
    """What is wrong with the files of the checkpoint ``folder``, one sentence per damaged or
    missing file, each naming it; empty if every file looks whole."""
    folder = Path(folder)
    return _config_damage(folder) + _shard_damage(folder) + _common_damage(folder)


def _config_damage(folder: Path) -> list[str]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return [f"{path} is missing"]
    try:
        config = json.loads(path.read_bytes())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        return [f"{path} is not valid JSON ({err})"]
    return [] if isinstance(config, dict) else [f"{path} is not a JSON object"]


def _shard_damage(folder: Path) -> list[str]:
    if not (folder / METADATA_FILE).is_file():
        return [f"{folder / METADATA_FILE} is missing"]
    try:
        metadata = check_metadata(folder)
    except ValueError as err:
        return [str(err)]
    needed: dict[str, int] = {}  # file -> the end of the furthest item it holds
    for item in getattr(metadata, "storage_data", {}).values():
        end = item.offset + item.length
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    damage = []
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            damage.append(f"{path} is missing (listed in {METADATA_FILE})")
        elif path.stat().st_size < size:
            damage.append(
                f"{path} is truncated: {path.stat().st_size} bytes, but {METADATA_FILE} "
                f"places items up to byte {size}"
            )
    return damage


def _common_damage(folder: Path) -> list[str]:
    path = folder / COMMON_FILE
    if not path.is_file():
        return [f"{path} is missing"]
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return [f"{path} cannot be read ({err}; truncated or overwritten)"]
    return [] if bad is None else [f"{path} is damaged: its member {bad} fails its checksum"]
