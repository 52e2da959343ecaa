"""Folder manifests: every kind of damage is found and named, and an intact folder passes."""

from __future__ import annotations

import os

import pytest

from bapo_megatron.files.manifest import (
    MANIFEST_FILE,
    DamagedFolder,
    check_digests,
    check_listing,
    digests,
    folder_files,
    read_manifest,
    share_of,
    write_manifest,
)


def _folder(tmp_path):
    folder = tmp_path / "step"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "__0_0.distcp").write_bytes(os.urandom(10_000))
    (folder / "model" / "metadata.json").write_text('{"a": 1}')
    (folder / "rank_00000.pt").write_bytes(os.urandom(333))
    files = folder_files(folder)
    # two "ranks" hash their shares; together they cover every file once
    shares = [share_of(files, rank, 2) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == files
    entries = {**digests(folder, shares[0]), **digests(folder, shares[1])}
    write_manifest(folder, entries)
    return folder, files


def _check(folder):
    entries = read_manifest(folder)
    check_listing(folder, entries)
    check_digests(folder, entries, folder_files(folder))


def test_an_intact_folder_passes(tmp_path):
    folder, files = _folder(tmp_path)
    assert files == ["model/__0_0.distcp", "model/metadata.json", "rank_00000.pt"]
    _check(folder)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda f: (f / "model" / "__0_0.distcp").write_bytes(b"x" * 5000),
            r"model/__0_0.distcp is 5000 bytes, 10000 when written \(truncated or overwritten\)",
        ),
        (
            lambda f: (f / "model" / "metadata.json").write_text('{"b": 2}'),
            r"model/metadata.json: its contents changed since it was written",
        ),
        (
            lambda f: (f / "rank_00000.pt").unlink(),
            r"rank_00000.pt is missing \(listed in manifest.json\)",
        ),
        (
            lambda f: (f / "extra.bin").write_bytes(b"1"),
            r"files not in its manifest.json: \['extra.bin'\]",
        ),
        (lambda f: (f / MANIFEST_FILE).write_text("{garbage"), r"manifest.json is not a manifest"),
        (lambda f: (f / MANIFEST_FILE).unlink(), r"manifest.json is missing"),
    ],
)
def test_each_damage_is_named(tmp_path, damage, message):
    folder, _ = _folder(tmp_path)
    damage(folder)
    with pytest.raises(DamagedFolder, match=message):
        _check(folder)


def test_a_manifest_must_cover_every_file(tmp_path):
    folder, files = _folder(tmp_path)
    with pytest.raises(ValueError, match="no digest for"):
        write_manifest(folder, digests(folder, files[:1]))
