"""What a trainer checkpoint records about itself, and the checks a resume makes before it
loads anything: the ``trainer`` section of ``bapo_checkpoint.json`` (:class:`TrainerInfo`), the
per-rank files (read as plain data only), and whether the checkpoint belongs to this run (model,
world size, layout, optimizer kind, schedule, identifying settings). The format itself is
described in :mod:`bapo_megatron.trainer.checkpoint`."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing

from bapo_megatron.actor.actor import Actor
from bapo_megatron.config import ModelConfig
from bapo_megatron.weights.megatron_checkpoint import (
    INFO_FILE,
    check_same_model,
    read_checkpoint_info,
)

TRAINER_FORMAT_VERSION = 2
"""Version of the ``trainer`` section and of the per-rank files; bumped on incompatible changes.
Version 1 pickled Python objects (NumPy arrays, rollout samples) into the per-rank files."""
PICKLED_FORMAT_VERSION = 1
RANK_FILE = "rank_{rank:05d}.pt"
# ParallelConfig fields that decide which rank holds what (data parallel follows from the world
# size).
LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
)
# OptimizerParamScheduler.state_dict() entries that come from the run's OptimizerConfig (the
# others, num_steps, is progress): a resumed run must have the same, or its schedule would jump.
SCHEDULE_FIELDS = {
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


_PLAIN_LEAVES = (type(None), bool, int, float, str, torch.Tensor)


def check_plain(value: Any, where: str) -> None:
    """``ValueError`` naming the first part of ``value`` that is not plain data: what
    ``torch.load(weights_only=True)`` reads back without unpickling a Python object."""
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) not in (str, int):
                raise ValueError(f"{where} has the key {key!r}; keys must be strings or integers")
            check_plain(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
    elif type(value) not in _PLAIN_LEAVES and not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, "
            "numbers, strings, None and lists/tuples/dicts of them (so that loading "
            "it never unpickles Python objects)"
        )


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
        if version == PICKLED_FORMAT_VERSION:
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


def check_matches_run(folder: Path, info: TrainerInfo, actor: Actor) -> None:
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
    for field, config_name in SCHEDULE_FIELDS.items():
        if info.scheduler.get(field) != current[field]:
            raise ValueError(
                f"checkpoint {folder}: scheduler.{field} is {info.scheduler.get(field)!r}, but "
                f"this run's is {current[field]!r} (from optimizer.{config_name}); resuming "
                "would change the learning-rate/weight-decay schedule"
            )


def check_same_run(
    folder: Path,
    info: TrainerInfo,
    identity: dict[str, Any],
    defaults: dict[str, Any] | None = None,
) -> None:
    """The run that saved ``folder`` must have had this run's identifying settings; a setting
    the checkpoint does not record was saved with its value in ``defaults`` (settings added
    after the checkpoint was written), else None."""
    saved = {**(defaults or {}), **(info.run or {})}
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


def check_files(folder: Path, world_size: int) -> None:
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


def read_rank_file(folder: Path, step: int, rank: int) -> dict:
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
        check_plain(state, "the file")  # weights_only also lets a few allow-listed classes in
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
