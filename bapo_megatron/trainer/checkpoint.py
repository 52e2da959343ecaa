"""Trainer checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is one folder per saved step, ``<root>/step_<step:08d>/``, written aside and renamed
into place once every rank has finished (:func:`~bapo_megatron.files.atomic.staged_folder`),
so a folder with that name is always complete; a killed run leaves only a hidden
``.step_<step>.incomplete`` folder, which :func:`latest_checkpoint` ignores. It holds:

- Megatron ``dist_checkpointing`` files (torch_dist) with the model (``model``, or ``model0``,
  ``model1``... with virtual pipelining) and the optimizer state built by Megatron from it
  (``optimizer.sharded_state_dict(model_state)``: Adam moments and step, param groups);
- ``bapo_checkpoint.json`` (rank 0): the weights checkpoint's record of
  :mod:`bapo_megatron.weights.megatron_checkpoint` (format version, model config), so the
  folder is also a weights checkpoint that loads at any layout and converts to HF, plus a
  ``trainer`` section: its own format version, the step, world size and layout, whether the
  optimizer was distributed, ``Actor.skipped_steps`` and the learning-rate scheduler's state;
- ``rank_<rank:05d>.pt``, one per rank (``torch.save``): the step, the rank, its RNG states
  (:mod:`~bapo_megatron.trainer.rng_state`) and the caller's ``trainer_state``, which may differ
  from rank to rank (a replay buffer held by some ranks, a data-loader position...).

Loading a checkpoint never runs code from it: the per-rank files hold plain data only (tensors,
numbers, strings, None, lists/tuples/dicts of them; :func:`save_checkpoint` refuses anything
else) and are read with ``torch.load(weights_only=True)``. Files of format version 1, which held
pickled Python objects, are refused. Megatron's own files: ``common.pt`` is read by
``torch.load`` with torch's default ``weights_only=True`` (torch >= 2.6, with Megatron's
allow-list of plain classes); ``.metadata``, which torch's ``FileSystemReader`` unpickles in
full, is first checked by
:func:`~bapo_megatron.megatron_patches.checkpoint_metadata.check_metadata`.

The per-rank files tie a checkpoint to the world size and layout it was saved at: rank r's RNG
and trainer state only mean something to the same rank r of the same layout, so
:func:`load_checkpoint` refuses another layout (the weights alone still load anywhere through
:func:`~bapo_megatron.weights.megatron_checkpoint.load_megatron_checkpoint`).

Megatron's optimizer checkpoints assume fused Adams; the repairs torch's Adam needs are in
:mod:`bapo_megatron.megatron_patches.optimizer_state`. Two more choices follow from them: the
distributed optimizer is saved in its ``dp_reshardable`` format (the default
``fully_sharded_model_space`` needs ``flattened_range``, which the torch_dist format dropped;
``fully_reshardable`` loses ``step``), and loading it copies into views of leaf parameters, so it
runs under ``torch.no_grad()``. A bf16 model holds only bf16 parameters
(:func:`bapo_megatron.actor.model.build_model` casts the local spec's float32 norm weights):
Megatron 0.16's optimizers cannot checkpoint a mix of the two.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing

from bapo_megatron.actor.actor import Actor
from bapo_megatron.distributed.collectives import barrier, on_every_rank
from bapo_megatron.files.atomic import staged_folder
from bapo_megatron.megatron_patches.checkpoint_metadata import check_metadata
from bapo_megatron.megatron_patches.checkpoint_writer_queue import (
    checkpoint_writer_queue_in_process,
)
from bapo_megatron.megatron_patches.child_processes import forked_writers_end_with_us
from bapo_megatron.megatron_patches.cpu_runtime import cuda_sites_on_cpu
from bapo_megatron.megatron_patches.optimizer_state import (
    add_zero_common_step,
    init_adam_state,
    restore_adam_steps,
    torch_adams,
)
from bapo_megatron.trainer import rng_state
from bapo_megatron.trainer.checkpoint_info import (
    LAYOUT_FIELDS,
    RANK_FILE,
    TRAINER_FORMAT_VERSION,
    check_files,
    check_matches_run,
    check_plain,
    check_same_run,
    read_rank_file,
    read_trainer_info,
)
from bapo_megatron.trainer.checkpoint_integrity import write_checkpoint_manifest
from bapo_megatron.trainer.state import IDENTITY_DEFAULTS
from bapo_megatron.weights.megatron_checkpoint import (
    FORMAT_VERSION as WEIGHTS_FORMAT_VERSION,
)
from bapo_megatron.weights.megatron_checkpoint import (  # the weights part of the format
    INFO_FILE,
    _unwrap,
    state_keys,
)

STEP_FOLDER = "step_{step:08d}"
_STEP_FOLDER_NAME = re.compile(r"step_(\d{8,})")
# How Megatron's distributed optimizer shards its state in the checkpoint (see the module
# docstring); the other optimizers ignore it.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# ------------------------------------------------------------------------------------ save


def save_checkpoint(
    root: str | Path,
    step: int,
    actor: Actor,
    trainer_state: dict,
    *,
    keep_last: int | None,
    identity: dict[str, Any] | None = None,
) -> Path:
    """Save the run after ``step`` to ``root/step_<step:08d>/`` and return that folder.

    Collective over the world: every rank calls it with its own ``actor`` and ``trainer_state``
    (a dict of plain data: tensors, numbers, strings, None and lists/tuples/dicts of them; it may
    differ per rank). The folder appears only once complete; one left
    from an earlier run at the same step is replaced then. Afterwards, rank 0 deletes the oldest
    ``step_*`` folders below ``step`` so that ``keep_last`` remain, this one included (None keeps
    all; folders of later steps, from another history, are left alone). ``identity`` (the run's
    identifying settings) is recorded so that a resume by another run is refused; the folder
    gets a manifest of its files (:mod:`~bapo_megatron.trainer.checkpoint_integrity`).
    """
    _check_can_save(step, actor, trainer_state, keep_last)
    root = Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)  # every rank: exist_ok makes the race harmless
    folder = root / STEP_FOLDER.format(step=step)
    context = actor.context
    with staged_folder(folder, overwrite=True) as staging:
        state = _sharded_state(actor, is_loading=False)
        with cuda_sites_on_cpu():  # the optimizer's pieces and the save exchange ask for CUDA
            checkpoint_writer_queue_in_process()
            forked_writers_end_with_us()
            dist_checkpointing.save(state, str(staging))
        on_every_rank(
            lambda: _write_rank_file(staging, step, context.rank, trainer_state),
            where=f"checkpoint {folder}",
            catch=ValueError,
            error_type=ValueError,
            describe=str,
        )

        def write_info() -> None:
            if context.rank == 0:
                info = _info_json(step, actor, identity)
                (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")

        on_every_rank(write_info, where=f"checkpoint {folder}", catch=OSError, error_type=OSError)
        write_checkpoint_manifest(staging)
    if keep_last is not None and context.rank == 0:
        _delete_old_checkpoints(root, step, keep_last)
    barrier()  # on return, every rank sees the pruned root
    return folder


def _check_can_save(step: int, actor: Actor, trainer_state: dict, keep_last: int | None) -> None:
    """Refuse, on every rank alike and before any collective, what could not be saved or resumed."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an integer >= 0, got {step!r}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"save_checkpoint: keep_last must be a positive integer or None, got {keep_last!r}"
        )
    if not isinstance(trainer_state, dict):
        raise TypeError(
            f"save_checkpoint: trainer_state must be a dict, got {type(trainer_state).__name__}"
        )


def _write_rank_file(staging: Path, step: int, rank: int, trainer_state: dict) -> None:
    """This rank's file (RNG states, ``trainer_state``); ``ValueError`` if ``trainer_state``
    holds anything but plain data."""
    try:
        check_plain(trainer_state, "trainer_state")
    except ValueError as err:
        raise ValueError(f"trainer_state of rank {rank} cannot be saved: {err}") from None
    torch.save(
        {
            "format_version": TRAINER_FORMAT_VERSION,
            "step": step,
            "rank": rank,
            "rng": rng_state.capture(),
            "trainer_state": trainer_state,
        },
        staging / RANK_FILE.format(rank=rank),
    )


def _sharded_state(actor: Actor, *, is_loading: bool) -> dict:
    """Megatron's sharded state dict of the model chunks and, built from it, the optimizer's
    (whose tensors, on load, are where the loaded values go)."""
    modules = [_unwrap(chunk) for chunk in actor.chunks]
    state = {
        key: module.sharded_state_dict() for key, module in zip(state_keys(len(modules)), modules)
    }
    init_adam_state(actor.optimizer)
    with cuda_sites_on_cpu():
        state["optimizer"] = actor.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        )
    return state


def _info_json(step: int, actor: Actor, identity: dict[str, Any] | None) -> dict:
    """``bapo_checkpoint.json``: the weights checkpoint's fields, then the trainer's."""
    parallel = actor.context.config
    return {
        "format_version": WEIGHTS_FORMAT_VERSION,
        "model": dataclasses.asdict(actor.model_config),
        "hf_dtype": None,
        "trainer": {
            "format_version": TRAINER_FORMAT_VERSION,
            "step": step,
            "world_size": actor.context.world_size,
            "layout": {name: getattr(parallel, name) for name in LAYOUT_FIELDS},
            "use_distributed_optimizer": actor.optimizer_config.use_distributed_optimizer,
            "skipped_steps": actor.skipped_steps,
            "scheduler": actor.scheduler.state_dict(),
            "run": identity,
        },
    }


def _delete_old_checkpoints(root: Path, step: int, keep_last: int) -> None:
    """Remove the ``step_*`` folders of steps before ``step``, all but the ``keep_last - 1``
    newest."""
    older = sorted((s, path) for s, path in _step_folders(root) if s < step)
    for _, path in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(path)


# ------------------------------------------------------------------------------------ find


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``; staging folders start with a
    dot and do not match."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_FOLDER_NAME.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return found


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Every complete checkpoint folder under ``root``, the newest (highest step) first."""
    return [path for _, path in sorted(_step_folders(Path(root)), reverse=True)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint folder of the highest step under ``root``, or None when there is none (or
    no ``root``). Only folders renamed into place count; ``.step_*.incomplete`` ones left by a
    killed run do not. Whether the folder is well-formed is checked by :func:`load_checkpoint`."""
    folders = _step_folders(Path(root))
    return max(folders)[1] if folders else None


# ------------------------------------------------------------------------------------ load


def load_checkpoint(
    folder: str | Path, actor: Actor, identity: dict[str, Any] | None = None
) -> tuple[int, dict]:
    """Restore ``actor`` (weights, optimizer state, schedule, skipped steps) and this rank's RNG
    states from the checkpoint ``folder``; return ``(step, this rank's trainer_state)``.

    Collective over the world. Everything that can be checked is checked before anything is
    loaded, and every rank reaches the same verdict: ``ValueError`` naming the file or field
    when the folder is not a complete trainer checkpoint, belongs to another model, was saved by
    another world size or layout, or with the other optimizer kind, or (given ``identity``) by
    a run with other identifying settings.
    """
    folder = Path(folder).absolute()
    info = read_trainer_info(folder)
    check_matches_run(folder, info, actor)
    if identity is not None:
        check_same_run(folder, info, identity, IDENTITY_DEFAULTS)
    check_files(folder, info.world_size)
    check_metadata(folder)
    rank_state = on_every_rank(
        lambda: read_rank_file(folder, info.step, actor.context.rank),
        where=f"checkpoint {folder}",
        catch=ValueError,
        error_type=ValueError,
        describe=str,
    )

    state = _sharded_state(actor, is_loading=True)
    with cuda_sites_on_cpu():
        loaded = dist_checkpointing.load(state, str(folder))
    keys = state_keys(len(actor.chunks))
    for key, chunk in zip(keys, actor.chunks):
        _unwrap(chunk).load_state_dict(loaded[key], strict=True)
    distributed = actor.optimizer_config.use_distributed_optimizer
    if not distributed and torch_adams(actor.optimizer):
        add_zero_common_step(loaded["optimizer"])
    # no_grad: the distributed optimizer copies into views of the (leaf, requires-grad) params.
    with cuda_sites_on_cpu(), torch.no_grad():
        actor.optimizer.load_state_dict(loaded["optimizer"])
    if distributed:
        restore_adam_steps(actor.optimizer)
    _load_scheduler(actor, info.scheduler)
    actor.skipped_steps = info.skipped_steps
    rng_state.restore(rank_state["rng"])  # last: nothing after it draws random numbers
    return info.step, rank_state["trainer_state"]


def _load_scheduler(actor: Actor, saved: dict[str, Any]) -> None:
    """Restore the schedule's progress (its shape was checked by :func:`check_matches_run`)."""
    actor.scheduler.num_steps = 0  # load_state_dict advances by the saved count
    actor.scheduler.load_state_dict(saved)
