"""Megatron-Core distributed checkpoints (torch_dist) of the actor's weights, at any layout.

A checkpoint folder holds Megatron's ``dist_checkpointing`` files, which describe every tensor
by its global shape and each rank's piece by offsets, so a checkpoint saved at one layout loads
at any other (TP2/PP2 -> TP1/PP2, TP2/DP2, TP1/PP1...): resharding happens on load. Next to them:

- ``bapo_checkpoint.json``: the :class:`~bapo_megatron.config.ModelConfig` the weights belong to
  and, for checkpoints converted from HF, the dtype the HF weights were stored in;
- ``hf/``: the HF folder's other files (config, tokenizer, generation config), copied byte for
  byte, so that the way back to HF restores them.

The state dict is ``{"model": ...}`` for one chunk and ``{"model0": ..., "model1": ...}`` with
virtual pipelining, as Megatron's training checkpoints; the on-disk keys do not depend on it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from bapo_megatron.config import ModelConfig
from bapo_megatron.config.value_types import build_dataclass
from bapo_megatron.files.atomic import staged_folder
from bapo_megatron.megatron_patches.checkpoint_metadata import check_metadata
from bapo_megatron.megatron_patches.checkpoint_writer_queue import (
    checkpoint_writer_queue_in_process,
)
from bapo_megatron.megatron_patches.child_processes import forked_writers_end_with_us
from bapo_megatron.weights.checkpoint_damage import find_damage
from bapo_megatron.weights.hf_checkpoint import DTYPE_NAMES, copy_files

INFO_FILE = "bapo_checkpoint.json"
HF_FILES_DIR = "hf"
FORMAT_VERSION = 1
# Fields that describe the weights; max_position_embeddings is a run setting.
_RUN_FIELDS = ("max_position_embeddings",)


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``bapo_checkpoint.json`` records."""

    model: ModelConfig
    """The architecture (and ``params_dtype``: the dtype the tensors were saved in)."""
    hf_dtype: str | None
    """Dtype of the HF weights the checkpoint was converted from; None if it was not."""


def state_keys(num_chunks: int) -> list[str]:
    """Top-level state-dict keys of the chunks, as Megatron's training checkpoints name them."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def save_megatron_checkpoint(
    chunks: Sequence[torch.nn.Module],
    model: ModelConfig,
    folder: str | Path,
    *,
    hf_dtype: torch.dtype | None = None,
    hf_files: Iterable[Path] = (),
    overwrite: bool = False,
) -> None:
    """Save this rank's ``chunks`` of ``model`` to ``folder`` (collective over the world).

    The folder appears only once complete (:func:`~bapo_megatron.files.atomic.staged_folder`).
    ``hf_dtype`` and ``hf_files`` (config, tokenizer...) are recorded for the way back to HF.
    """
    hf_files = list(hf_files)
    with staged_folder(folder, overwrite=overwrite) as staging:
        state = {
            key: _unwrap(chunk).sharded_state_dict()
            for key, chunk in zip(state_keys(len(chunks)), chunks)
        }
        checkpoint_writer_queue_in_process()
        forked_writers_end_with_us()
        dist_checkpointing.save(state, str(staging))
        if not dist.is_initialized() or dist.get_rank() == 0:
            info = {
                "format_version": FORMAT_VERSION,
                "model": dataclasses.asdict(model),
                "hf_dtype": DTYPE_NAMES[hf_dtype] if hf_dtype is not None else None,
            }
            (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
            if hf_files:
                (staging / HF_FILES_DIR).mkdir()
                copy_files(hf_files, staging / HF_FILES_DIR)


def read_checkpoint_info(folder: str | Path) -> CheckpointInfo:
    """The model and origin recorded in a checkpoint folder; ``ValueError`` naming the file."""
    path = Path(folder) / INFO_FILE
    if not path.is_file():
        raise ValueError(
            f"Megatron checkpoint {folder}: {INFO_FILE} does not exist (not a "
            "checkpoint written by bapo_megatron, or an incomplete one)"
        )
    try:
        info = json.loads(path.read_text())
        version = info["format_version"]
        fields = info["model"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"Megatron checkpoint {path} is malformed: {err!r}") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version} is not {FORMAT_VERSION}")
    try:  # build_dataclass: the model section nests a dataclass (rope_scaling)
        model = build_dataclass(ModelConfig, fields, prefix="model")
    except ValueError as err:
        raise ValueError(f"Megatron checkpoint {path} is malformed: {err}") from None
    return CheckpointInfo(model=model, hf_dtype=info.get("hf_dtype"))


def check_same_model(expected: ModelConfig, found: ModelConfig, where: str) -> None:
    """``ValueError`` naming the first field (other than run settings) that differs."""
    for field in dataclasses.fields(ModelConfig):
        if field.name in _RUN_FIELDS:
            continue
        a, b = getattr(expected, field.name), getattr(found, field.name)
        if a != b:
            raise ValueError(f"{where}: model.{field.name} is {b!r}, but the model has {a!r}")


def load_megatron_checkpoint(
    chunks: Sequence[torch.nn.Module], model: ModelConfig, folder: str | Path
) -> None:
    """Load the checkpoint ``folder`` into this rank's ``chunks`` of ``model``, whatever layout
    it was saved at (collective over the world). The recorded model must equal ``model``; a
    load that fails on a damaged file raises ``ValueError`` naming the file
    (:func:`~bapo_megatron.weights.checkpoint_damage.find_damage`)."""
    info = read_checkpoint_info(folder)
    check_same_model(model, info.model, f"Megatron checkpoint {folder}")
    modules = [_unwrap(chunk) for chunk in chunks]
    keys = state_keys(len(modules))
    state = {key: module.sharded_state_dict() for key, module in zip(keys, modules)}
    check_metadata(folder)  # the one file torch's reader unpickles in full
    try:
        loaded = dist_checkpointing.load(state, str(folder))
    except (Exception, CheckpointException) as err:  # torch's is a BaseException
        damage = find_damage(folder)  # the readers' own errors seldom name the file
        if not damage:
            raise
        raise ValueError(
            f"Megatron checkpoint {folder} is damaged: {'; '.join(damage)} (loading it failed "
            f"with {_describe_load_failure(err)})"
        ) from err
    for key, module in zip(keys, modules):
        module.load_state_dict(loaded[key], strict=True)


def _describe_load_failure(error: BaseException) -> str:
    """``Type: message`` (its first line, cut at 120 characters); for torch's
    ``CheckpointException``, which only lists ranks, the exception of the first failed rank."""
    where = ""
    ranks = sorted(getattr(error, "failures", None) or {})
    if isinstance(error, CheckpointException) and ranks:
        failure = error.failures[ranks[0]]
        error = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
        where = f" on rank {ranks[0]}" + (f" and {len(ranks) - 1} more" if len(ranks) > 1 else "")
    text = (str(error).splitlines() or [""])[0]
    text = text if len(text) <= 120 else text[:117] + "..."
    return f"{type(error).__name__}{': ' + text if text else ''}{where}"
