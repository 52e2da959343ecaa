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
runs under ``torch.no_grad()``. One case is refused: a bf16 model with float32 parameters (the
local spec's norms, i.e. without Transformer Engine) and the non-distributed optimizer, whose
``Float16OptimizerWithFloat16Params`` cannot build its sharded state dict; :func:`save_checkpoint`
refuses before writing (the distributed optimizer checkpoints that model exactly).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

from bapo_megatron.actor.actor import Actor
from bapo_megatron.config import ModelConfig
from bapo_megatron.distributed.collectives import barrier, on_every_rank
from bapo_megatron.files.atomic import staged_folder
from bapo_megatron.megatron_patches.checkpoint_metadata import check_metadata
from bapo_megatron.megatron_patches.checkpoint_writer_queue import (
    checkpoint_writer_queue_ends_with_us,
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
from bapo_megatron.trainer.checkpoint_integrity import write_checkpoint_manifest
from bapo_megatron.weights.megatron_checkpoint import (
    FORMAT_VERSION as WEIGHTS_FORMAT_VERSION,
)
from bapo_megatron.weights.megatron_checkpoint import (  # the weights part of the format
    INFO_FILE,
    _unwrap,
    check_same_model,
    read_checkpoint_info,
    state_keys,
)

TRAINER_FORMAT_VERSION = 2
"""Version of the ``trainer`` section and of the per-rank files; bumped on incompatible changes.
Version 1 pickled Python objects (NumPy arrays, rollout samples) into the per-rank files."""
_PICKLED_FORMAT_VERSION = 1
STEP_FOLDER = "step_{step:08d}"
_STEP_FOLDER_NAME = re.compile(r"step_(\d{8,})")
RANK_FILE = "rank_{rank:05d}.pt"
# ParallelConfig fields that decide which rank holds what (data parallel follows from the world
# size).
LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
)
# How Megatron's distributed optimizer shards its state in the checkpoint (see the module
# docstring); the other optimizers ignore it.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# OptimizerParamScheduler.state_dict() entries that come from the run's OptimizerConfig (the
# others, num_steps, is progress): a resumed run must have the same, or its schedule would jump.
_SCHEDULE_FIELDS = {
    "max_lr": "lr",
    "min_lr": "min_lr",
    "lr_warmup_steps": "lr_warmup_steps",
    "lr_decay_steps": "lr_decay_steps",
    "lr_decay_style": "lr_decay_style",
    "start_wd": "weight_decay",
    "end_wd": "weight_decay",
}


@dataclass(frozen=True)
class TrainerInfo:
    """What the ``trainer`` section of ``bapo_checkpoint.json`` records."""

    model: ModelConfig
    """The architecture the weights belong to."""
    step: int
    """The training step the checkpoint was taken after (the caller's count)."""
    world_size: int
    """Processes that saved it: one per-rank file each."""
    layout: dict[str, int | None]
    """The :data:`LAYOUT_FIELDS` of the run's ParallelConfig."""
    use_distributed_optimizer: bool
    """Whether the optimizer state was sharded over data-parallel ranks."""
    skipped_steps: int
    """``Actor.skipped_steps`` at the save."""
    scheduler: dict[str, Any]
    """``OptimizerParamScheduler.state_dict()`` at the save."""
    run: dict[str, Any] | None
    """The settings that identify the run that saved it (seeds, initial weights, data:
    :func:`bapo_megatron.trainer.state.run_identity`), or None if the saver gave none."""


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
            checkpoint_writer_queue_ends_with_us()
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
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        if isinstance(inner, Float16OptimizerWithFloat16Params) and any(
            inner.fp32_from_fp32_groups
        ):
            # Its sharded_state_dict maps optimizer state to the bf16 parameters only and fails
            # on the others ("Param id ... does not match any model sharded param").
            raise ValueError(
                "save_checkpoint: model.params_dtype=bfloat16 with some parameters kept in "
                "float32 (the norm weights of the local layer spec, used without Transformer "
                "Engine) cannot be checkpointed by Megatron's non-distributed mixed-precision "
                "optimizer; set optimizer.use_distributed_optimizer=true, whose checkpoints "
                "handle them"
            )


def _write_rank_file(staging: Path, step: int, rank: int, trainer_state: dict) -> None:
    """This rank's file (RNG states, ``trainer_state``); ``ValueError`` if ``trainer_state``
    holds anything but plain data."""
    try:
        _check_plain(trainer_state, "trainer_state")
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


_PLAIN_LEAVES = (type(None), bool, int, float, str, torch.Tensor)


def _check_plain(value: Any, where: str) -> None:
    """``ValueError`` naming the first part of ``value`` that is not plain data: what
    ``torch.load(weights_only=True)`` reads back without unpickling a Python object."""
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise ValueError(f"{where} has the key {key!r}; keys must be strings or integers")
            _check_plain(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif type(value) not in _PLAIN_LEAVES and not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, "
            "numbers, strings, None and lists/tuples/dicts of them (so that loading "
            "it never unpickles Python objects)"
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
    _check_matches_run(folder, info, actor)
    if identity is not None:
        _check_same_run(folder, info, identity)
    _check_files(folder, info.world_size)
    check_metadata(folder)
    rank_state = on_every_rank(
        lambda: _read_rank_file(folder, info.step, actor.context.rank),
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


def read_trainer_info(folder: str | Path) -> TrainerInfo:
    """The ``bapo_checkpoint.json`` of a trainer checkpoint; ``ValueError`` naming the file and
    field when it is missing, malformed, of another format version, or weights-only."""
    folder = Path(folder)
    weights = read_checkpoint_info(folder)  # the file, its format version and the model
    path = folder / INFO_FILE
    trainer = json.loads(path.read_text()).get("trainer")
    if trainer is None:
        raise ValueError(
            f"{path} has no `trainer` section: a weights-only checkpoint (load it "
            "with load_megatron_checkpoint), not one a run can resume from"
        )
    try:
        version = trainer["format_version"]
        if version == _PICKLED_FORMAT_VERSION:
            raise ValueError(
                f"{path}: trainer.format_version is 1, whose per-rank files "
                f"({folder / RANK_FILE.format(rank=0)}...) hold pickled Python objects that only "
                "load by unpickling them, which can run any code the file carries; they are not "
                "loaded. Start a fresh run from its weights (train.load_checkpoint="
                f"{folder}, checkpoint.resume=false, another train.output_dir), or resume it "
                "with the bapo-megatron version that wrote it"
            )
        if version != TRAINER_FORMAT_VERSION:
            raise ValueError(
                f"{path}: trainer.format_version {version} is not {TRAINER_FORMAT_VERSION}"
            )
        info = TrainerInfo(
            model=weights.model,
            step=trainer["step"],
            world_size=trainer["world_size"],
            layout=trainer["layout"],
            use_distributed_optimizer=trainer["use_distributed_optimizer"],
            skipped_steps=trainer["skipped_steps"],
            scheduler=trainer["scheduler"],
            run=trainer.get("run"),
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} is malformed: trainer field {err} is missing or wrong") from None
    for name in ("step", "world_size", "skipped_steps"):
        value = getattr(info, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path} is malformed: trainer.{name} is {value!r}")
    if not isinstance(info.layout, dict) or set(info.layout) != set(LAYOUT_FIELDS):
        raise ValueError(f"{path} is malformed: trainer.layout must name {list(LAYOUT_FIELDS)}")
    if not isinstance(info.scheduler, dict) or "num_steps" not in info.scheduler:
        raise ValueError(f"{path} is malformed: trainer.scheduler is not a scheduler state")
    return info


def _check_matches_run(folder: Path, info: TrainerInfo, actor: Actor) -> None:
    """The model, world size, layout, optimizer kind and schedule must be the run's."""
    check_same_model(actor.model_config, info.model, f"checkpoint {folder}")
    context = actor.context
    ours = {name: getattr(context.config, name) for name in LAYOUT_FIELDS}
    differences = (
        [f"world size {info.world_size} (this run: {context.world_size})"]
        if info.world_size != context.world_size
        else []
    )
    differences += [
        f"parallel.{name}={info.layout[name]!r} (this run: {ours[name]!r})"
        for name in LAYOUT_FIELDS
        if info.layout[name] != ours[name]
    ]
    if differences:
        raise ValueError(
            f"checkpoint {folder} was saved with {', '.join(differences)}: its per-rank files "
            f"({RANK_FILE.format(rank=0)}...: RNG states, trainer_state) do not line up with this "
            "run's ranks; resume at the saved world size and layout (the weights alone load at "
            "any layout with load_megatron_checkpoint)"
        )
    ours_distributed = actor.optimizer_config.use_distributed_optimizer
    if info.use_distributed_optimizer != ours_distributed:
        raise ValueError(
            f"checkpoint {folder} was saved with optimizer.use_distributed_optimizer="
            f"{info.use_distributed_optimizer}, this run has {ours_distributed}: the optimizer "
            "states are laid out differently"
        )
    current = actor.scheduler.state_dict()
    for field, config_name in _SCHEDULE_FIELDS.items():
        if info.scheduler.get(field) != current[field]:
            raise ValueError(
                f"checkpoint {folder}: scheduler.{field} is {info.scheduler.get(field)!r}, but "
                f"this run's is {current[field]!r} (from optimizer.{config_name}); resuming "
                "would change the learning-rate/weight-decay schedule"
            )


def _check_same_run(folder: Path, info: TrainerInfo, identity: dict[str, Any]) -> None:
    """The run that saved ``folder`` must have had this run's identifying settings."""
    saved = info.run or {}
    differences = [
        f"{key}={saved.get(key)!r} (this run: {value!r})"
        for key, value in identity.items()
        if saved.get(key) != value
    ]
    if differences:
        raise ValueError(
            f"checkpoint {folder} belongs to another run: it was saved with "
            f"{', '.join(differences)}. Resume with those settings, or start afresh "
            "(checkpoint.resume=false moves it aside) or in another train.output_dir"
        )


def _check_files(folder: Path, world_size: int) -> None:
    """Megatron's metadata and one file per saved rank must be there (the same check on every
    rank, over the shared filesystem, so all ranks refuse together)."""
    if not dist_checkpointing.check_is_distributed_checkpoint(str(folder)):
        raise ValueError(
            f"checkpoint {folder}: Megatron's dist_checkpointing metadata "
            "(metadata.json) is missing: the folder is incomplete"
        )
    missing = [
        RANK_FILE.format(rank=r)
        for r in range(world_size)
        if not (folder / RANK_FILE.format(rank=r)).is_file()
    ]
    if missing:
        raise ValueError(
            f"checkpoint {folder}: per-rank file(s) {', '.join(missing)} missing "
            "(incomplete checkpoint)"
        )


def _read_rank_file(folder: Path, step: int, rank: int) -> dict:
    """This rank's file, checked to belong to ``step`` and ``rank``."""
    path = folder / RANK_FILE.format(rank=rank)
    try:
        # Plain data only: a Python object in the file is refused, never constructed.
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} cannot be read safely: it holds pickled Python objects, which "
            "loading would have to construct by running code named in the file, "
            f"so it is refused ({str(err).splitlines()[0]})"
        ) from None
    except Exception as err:  # noqa: BLE001 - any other failure means a damaged file
        raise ValueError(f"{path} cannot be read: {err!r}") from None
    if not isinstance(state, dict) or not {
        "format_version",
        "step",
        "rank",
        "rng",
        "trainer_state",
    } <= set(state):
        raise ValueError(f"{path} is malformed: not a per-rank trainer checkpoint file")
    try:
        _check_plain(state, "the file")  # weights_only also lets a few allow-listed classes in
    except ValueError as err:
        raise ValueError(f"{path} is malformed: {err}") from None
    if state["format_version"] != TRAINER_FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {state['format_version']} is not {TRAINER_FORMAT_VERSION}"
        )
    if state["step"] != step or state["rank"] != rank:
        raise ValueError(
            f"{path} holds step {state['step']} of rank {state['rank']}, but this is "
            f"step {step}'s file of rank {rank} (mixed-up folders?)"
        )
    return state


def _load_scheduler(actor: Actor, saved: dict[str, Any]) -> None:
    """Restore the schedule's progress (its shape was checked by :func:`_check_matches_run`)."""
    actor.scheduler.num_steps = 0  # load_state_dict advances by the saved count
    actor.scheduler.load_state_dict(saved)
