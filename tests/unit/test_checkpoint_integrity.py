"""Which checkpoint a resume trusts (``checkpoint.verify_checksums``), in one process: with
checksums, a checkpoint whose contents changed is skipped, named, for the one before; without
(sizes only), the same checkpoint passes, while a missing or truncated file is still found."""

from __future__ import annotations

import logging
import os

import pytest

from bapo_megatron.trainer.checkpoint_integrity import (
    newest_verified_checkpoint,
    write_checkpoint_manifest,
)


def checkpoint(root, step):
    folder = root / f"step_{step:08d}"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "__0_0.distcp").write_bytes(os.urandom(4096))
    (folder / "rank_00000.pt").write_bytes(os.urandom(512))
    write_checkpoint_manifest(folder)
    return folder


@pytest.fixture
def two(tmp_path):
    return checkpoint(tmp_path, 2), checkpoint(tmp_path, 1)  # newest first


def overwrite_same_size(path):
    """Damage that keeps the size: bytes flipped in place (bit rot, a partial overwrite)."""
    data = bytearray(path.read_bytes())
    data[100:200] = bytes(b ^ 0xFF for b in data[100:200])
    path.write_bytes(bytes(data))


def test_checksums_find_changed_contents_and_fall_back(two, caplog):
    newest, older = two
    assert newest_verified_checkpoint([newest, older], checksums=True) == newest
    overwrite_same_size(newest / "model" / "__0_0.distcp")
    with caplog.at_level(logging.WARNING):
        assert newest_verified_checkpoint([newest, older], checksums=True) == older
    assert any(
        "model/__0_0.distcp: its contents changed since it was written" in r.getMessage()
        for r in caplog.records
    )


def test_sizes_only_trusts_changed_contents_but_not_a_truncated_file(two, caplog):
    newest, older = two
    overwrite_same_size(newest / "model" / "__0_0.distcp")
    # verify_checksums=false: the same damage passes (what the setting gives up for speed)
    assert newest_verified_checkpoint([newest, older], checksums=False) == newest
    (newest / "rank_00000.pt").write_bytes(b"short")
    with caplog.at_level(logging.WARNING):
        assert newest_verified_checkpoint([newest, older], checksums=False) == older
    assert any(
        "rank_00000.pt is 5 bytes, 512 when written" in r.getMessage() for r in caplog.records
    )
    (older / "model" / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"no checkpoint verifies.*__0_0.distcp is missing"):
        newest_verified_checkpoint([newest, older], checksums=False)
