"""Where the reference policy of ``algorithm.kl`` gets its weights, for a fresh run and for a
resumed one (the reference never changes, so a resume must find the same weights again).

``reference: initial`` on a fresh run copies the actor's weights once they are in place (after
``warmup``); a random start (with or without warm-up) exists nowhere else, so it is also saved
to ``<output_dir>/reference``. A resumed run reads the starting weights again:
``train.model_path``, ``train.load_checkpoint`` or that folder. A path is read as a Megatron
checkpoint folder (``bapo_checkpoint.json``, any layout) or an HF folder (``config.json``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from bapo_megatron.actor.actor import Actor
from bapo_megatron.actor.reference import ReferencePolicy, build_reference, copy_actor_weights
from bapo_megatron.config import Config
from bapo_megatron.config.kl import INITIAL_REFERENCE
from bapo_megatron.data.task import Task
from bapo_megatron.weights.convert import load_hf_weights
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint
from bapo_megatron.weights.megatron_checkpoint import (
    INFO_FILE,
    check_same_model,
    load_megatron_checkpoint,
    save_megatron_checkpoint,
)

log = logging.getLogger("bapo_megatron.train")
REFERENCE_FOLDER = "reference"
"""Under ``train.output_dir``: the random start a reference `initial` was copied from."""


def check_reference_source(cfg: Config) -> None:
    """``ValueError`` naming ``algorithm.kl.reference`` when its folder is neither a Megatron
    checkpoint nor an HF folder (checked before any model is built)."""
    kl = cfg.algorithm.kl
    if kl is None or kl.reference in (None, INITIAL_REFERENCE):
        return
    folder = Path(kl.reference)
    if not (folder / INFO_FILE).is_file() and not (folder / "config.json").is_file():
        raise ValueError(
            f"algorithm.kl.reference={kl.reference!r}: not a Megatron checkpoint folder "
            f"({INFO_FILE}) nor an HF folder (config.json)"
        )


def start_reference(
    cfg: Config, task: Task, actor: Actor, output: Path, *, resumed: bool
) -> ReferencePolicy | None:
    """The run's reference policy with its weights (collective over the trainer world), or None
    without one. Call after the actor's initial weights are in place (or were resumed)."""
    kl = cfg.algorithm.kl
    if kl is None or not kl.has_reference:
        return None
    reference = build_reference(actor, offload=kl.offload)
    if kl.reference != INITIAL_REFERENCE:
        _load(reference, task, Path(kl.reference), "algorithm.kl.reference")
    elif not resumed:
        copy_actor_weights(reference, actor)
        if cfg.train.model_path is None and cfg.train.load_checkpoint is None:
            save_megatron_checkpoint(
                reference.chunks, task.model, output / REFERENCE_FOLDER, overwrite=True
            )
    elif cfg.train.model_path is not None:
        _load(reference, task, Path(cfg.train.model_path), "train.model_path")
    elif cfg.train.load_checkpoint is not None:  # a converted or a trainer checkpoint
        load_megatron_checkpoint(reference.chunks, task.model, cfg.train.load_checkpoint)
    else:
        saved = output / REFERENCE_FOLDER
        if not (saved / INFO_FILE).is_file():
            raise ValueError(
                f"algorithm.kl.reference=initial: the resumed run's random start should be in "
                f"{saved}, which holds no checkpoint (a run from random weights saves it when it "
                "starts); give algorithm.kl.reference a checkpoint folder instead"
            )
        _load(reference, task, saved, "algorithm.kl.reference")
    reference.to_host_if_offloaded()
    log.info("reference policy for the KL term ready (%s)", kl.reference)
    return reference


def _load(reference: ReferencePolicy, task: Task, folder: Path, field: str) -> None:
    if (folder / INFO_FILE).is_file():
        load_megatron_checkpoint(reference.chunks, task.model, folder)
        return
    model = task.model
    with HFCheckpoint.open(
        folder,
        params_dtype=model.params_dtype,
        max_position_embeddings=model.max_position_embeddings,
    ) as hf:
        check_same_model(model, hf.model, f"{field}={str(folder)!r}")
        load_hf_weights(reference.chunks, hf, reference.context)
