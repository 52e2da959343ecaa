"""A trainer checkpoint's manifest: written with the checkpoint, checked before a resume trusts it.

A checkpoint damaged after it was written (a truncated ``.distcp`` shard, a garbled
``metadata.json``, a truncated ``common.pt``) would otherwise fail deep inside Megatron's or
torch's readers without naming the file, and block every restart. With a manifest (the size and
SHA-256 of every file, :mod:`bapo_megatron.files.manifest`) the damage is found first and named,
and the resume falls back to the newest checkpoint that verifies.

Both directions are collective over the world: each rank hashes its share of the files (a large
run's checkpoint is hundreds of GB), and every rank reaches the same verdict.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from bapo_megatron.distributed.collectives import barrier, on_every_rank
from bapo_megatron.files.manifest import (
    DamagedFolder,
    check_digests,
    check_listing,
    digests,
    folder_files,
    read_manifest,
    share_of,
    write_manifest,
)

log = logging.getLogger(__name__)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def write_checkpoint_manifest(staging: Path) -> None:
    """Hash every file of the finished checkpoint ``staging`` (each rank its share) and write
    the manifest on rank 0. Call it once every rank has written its files."""
    barrier()  # every rank's files are complete before anyone lists the folder
    rank, world = _rank_and_world()
    files = folder_files(staging)
    mine = digests(staging, share_of(files, rank, world))
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    entries = {name: entry for part in everyone for name, entry in part.items()}

    def write() -> None:
        if rank == 0:
            write_manifest(staging, entries)

    # a full disk on rank 0 must stop every rank, not leave the others in the next collective
    on_every_rank(
        write, where=f"checkpoint manifest in {staging}", catch=OSError, error_type=OSError
    )


def verify_checkpoint(folder: Path, *, checksums: bool) -> None:
    """Raise ``ValueError`` (on every rank) naming the damaged file if ``folder`` does not match
    its manifest; sizes and the file list always, contents with ``checksums``."""
    rank, world = _rank_and_world()

    def check() -> None:
        entries = read_manifest(folder)
        check_listing(folder, entries)
        if checksums:
            check_digests(folder, entries, share_of(sorted(entries), rank, world))

    on_every_rank(
        check,
        where=f"checkpoint {folder}",
        catch=DamagedFolder,
        error_type=ValueError,
        describe=str,
    )


def newest_verified_checkpoint(folders: list[Path], *, checksums: bool) -> Path | None:
    """The first of ``folders`` (newest first) that verifies, logging each one skipped and why;
    None if there are none; ``ValueError`` listing every reason if none verifies (a run that
    silently started over would lose them all)."""
    skipped = []
    for folder in folders:
        try:
            verify_checkpoint(folder, checksums=checksums)
        except ValueError as err:
            log.warning("skipping checkpoint %s: %s", folder, err)
            skipped.append(str(err))
            continue
        if skipped:
            log.warning(
                "resuming from %s, the newest checkpoint that verifies (%d newer skipped)",
                folder,
                len(skipped),
            )
        return folder
    if skipped:
        raise ValueError(
            "no checkpoint verifies against its manifest: "
            + "; ".join(skipped)
            + ". Move the damaged folders aside (or set checkpoint.resume=false to start afresh)"
        )
    return None
