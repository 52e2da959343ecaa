"""HF checkpoint folder <-> Megatron distributed checkpoint, at the layout of the calling ranks.

Both directions run on every rank of a
:class:`~bapo_megatron.distributed.context.ParallelContext` (one process is the TP1/PP1 case) and
build the actor's chunks for this rank:

- :func:`hf_to_megatron`: each rank reads from the HF files only its own tensor-parallel slices
  of its own stage's tensors (memory-mapped, one tensor at a time), merges them into its shards
  with the family's name map, and the chunks are saved with ``dist_checkpointing``.
- :func:`megatron_to_hf`: the checkpoint is loaded at this layout (resharding on load), then the
  live export (:func:`~bapo_megatron.weights.export.export_weights`) gathers each stage's tensors
  bucket by bucket and each stage writes its buckets as safetensors shards; rank 0 names the
  shards, writes the index and restores the config and tokenizer files.

A mixture-of-experts model is built for conversion with Megatron's sequence parallelism
wherever TP > 1 (:func:`conversion_context`): its MoE layers want it in training, and it
changes no weight, so a conversion at any TP/PP/EP/expert-TP layout does not ask for it.

Outputs are staged and renamed into place (:mod:`~bapo_megatron.files.atomic`). An output must
lie apart from the inputs (not the same folder, inside one or containing one: replacing it would
destroy what is read), and a conversion holds its output's lock
(:meth:`~bapo_megatron.files.lock.FolderLock.beside`) from its first check to the rename, so two
conversions into one folder never mix their files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from bapo_megatron.actor.model import build_model
from bapo_megatron.config import ModelConfig
from bapo_megatron.distributed.collectives import raise_if_any_rank_failed
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.files.atomic import check_output, staged_folder
from bapo_megatron.files.lock import FolderLock, FolderLocked
from bapo_megatron.models.name_maps import (
    chunk_parameters,
    hf_tensor_shapes,
    merge,
    tp_slice,
)
from bapo_megatron.weights.export import export_weights
from bapo_megatron.weights.hf_checkpoint import (
    CONFIG_FILE,
    DTYPE_NAMES,
    HFCheckpoint,
    copy_files,
    name_shards,
    non_weight_files,
    read_model_config,
    write_shard,
)
from bapo_megatron.weights.megatron_checkpoint import (
    HF_FILES_DIR,
    check_same_model,
    load_megatron_checkpoint,
    read_checkpoint_info,
    save_megatron_checkpoint,
)
from bapo_megatron.weights.tp_assembly import make_transport

DEFAULT_SHARD_BYTES = 2 * 2**30
_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def check_apart(source: str | Path, out: str | Path, what: str) -> None:
    """``ValueError`` naming both folders when the output ``out`` is the input ``source`` (called
    ``what``), lies inside it or contains it, symlinks resolved: writing the output (and, with
    overwrite, replacing it) would destroy or mix into what the conversion reads."""
    found, written = Path(source).resolve(), Path(out).resolve()
    if written == found:
        relation = "is"
    elif written.is_relative_to(found):
        relation = "lies inside"
    elif found.is_relative_to(written):
        relation = "contains"
    else:
        return
    resolved = (
        f" (resolved: {written} and {found})"
        if (str(written), str(found)) != (str(Path(out).absolute()), str(Path(source).absolute()))
        else ""
    )
    raise ValueError(
        f"output {out} {relation} the {what} {source}{resolved}: the output must be a folder "
        "apart from what is converted"
    )


@contextlib.contextmanager
def output_locked(out_folder: str | Path) -> Iterator[None]:
    """Hold the lock of the output folder for the block (collective over the world): rank 0
    takes it; if another process holds it, every rank raises ``ValueError`` naming the holder's
    PID and host."""
    lock, failure = None, None
    if _is_rank0():
        try:
            lock = FolderLock.beside(out_folder, "conversion").acquire()
        except FolderLocked as err:
            failure = err
    raise_if_any_rank_failed(
        failure, where=f"output {out_folder}", error_type=ValueError, describe=str
    )
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def conversion_context(context: ParallelContext, model: ModelConfig) -> ParallelContext:
    """The context a conversion builds ``model`` under: ``context`` itself, or, for a
    mixture-of-experts model at TP > 1 without sequence parallelism, the same process groups
    with ``sequence_parallel`` on. Sequence parallelism shards activations, not weights (a
    checkpoint is the same with it or without), and the layout check asks for it with MoE
    layers at TP > 1 because Megatron's MoE layer refuses to train without it; a conversion
    never trains, so it takes it on rather than asking the user for it."""
    parallel = context.config
    if not model.is_moe or parallel.tensor_model_parallel_size == 1 or parallel.sequence_parallel:
        return context
    return dataclasses.replace(
        context, config=dataclasses.replace(parallel, sequence_parallel=True)
    )


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    hf: HFCheckpoint,
    context: ParallelContext,
    *,
    progress: bool = False,
) -> None:
    """Copy this rank's shards of the HF checkpoint ``hf`` into ``chunks`` (built for
    ``hf.model`` at the context's layout). Reads only this rank's slices from the files."""
    model = hf.model
    rules = {rule.megatron: rule for rule in hf.name_map.rules(model)}
    params = [(name, p) for chunk in chunks for name, p in chunk_parameters(chunk)]
    for name, param in tqdm(params, desc="HF -> Megatron", unit="tensor", disable=not progress):
        rule = rules.get(name)
        if rule is None:
            raise ValueError(
                f"parameter {name!r} of the Megatron model has no rule in the "
                f"{model.model_type!r} name map"
            )
        parts = []
        # an expert's matrices are split over the expert tensor-parallel group
        rank, size = (
            (context.tp_rank, context.tp_size)
            if rule.expert is None
            else (context.etp_rank, context.etp_size)
        )
        for hf_name, shape in zip(rule.hf, hf_tensor_shapes(rule, model)):
            if rule.tp_dim is None:
                parts.append(hf.read(hf_name))
            else:
                part = tp_slice(rule, shape[rule.tp_dim], rank, size)
                parts.append(hf.read(hf_name, rule.tp_dim, part))
        shard = merge(rule, parts, model)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"{rule.hf}: the tensor-parallel shard has shape "
                f"{tuple(shard.shape)}, but Megatron parameter {name!r} has "
                f"{tuple(param.shape)} at TP rank {context.tp_rank}"
            )
        param.copy_(shard)
        if (
            name == "embedding.word_embeddings.weight"
            and model.tie_word_embeddings
            and "lm_head.weight" in hf
        ):
            # a tied checkpoint that stores the output matrix too: it must be the same matrix
            head = hf.read(
                "lm_head.weight",
                rule.tp_dim,
                tp_slice(rule, model.vocab_size, context.tp_rank, context.tp_size),
            )
            if not torch.equal(head, parts[0]):
                raise ValueError(
                    f"HF checkpoint {hf.folder}: tie_word_embeddings is true, but "
                    "lm_head.weight differs from model.embed_tokens.weight"
                )


def hf_to_megatron(
    hf_folder: str | Path,
    out_folder: str | Path,
    context: ParallelContext,
    *,
    params_dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> tuple[ModelConfig, list[torch.nn.Module]]:
    """Convert the HF folder to a Megatron checkpoint at ``out_folder`` (collective).

    ``params_dtype`` (`float32` or `bfloat16`) is the dtype of the Megatron weights; default: the
    HF weights' when it is one of those, else float32. Returns the model and this rank's
    converted chunks (built under :func:`conversion_context`: a mixture-of-experts model at
    TP > 1 with sequence parallelism).
    """
    check_apart(hf_folder, out_folder, "HF folder")
    check_output(out_folder, overwrite)
    with output_locked(out_folder), HFCheckpoint.open(hf_folder) as hf:
        if params_dtype is None:
            params_dtype = (
                DTYPE_NAMES[hf.dtype] if hf.dtype in (torch.float32, torch.bfloat16) else "float32"
            )
        model = dataclasses.replace(hf.model, params_dtype=params_dtype)
        context = conversion_context(context, model)
        chunks = build_model(model, context.config, context, initialize=False)
        load_hf_weights(chunks, hf, context, progress=progress and _is_rank0())
        save_megatron_checkpoint(
            chunks,
            model,
            out_folder,
            hf_dtype=hf.dtype,
            hf_files=non_weight_files(hf_folder),
            overwrite=overwrite,
        )
        return model, chunks


def write_hf_folder(
    chunks: list[torch.nn.Module],
    model: ModelConfig,
    out_folder: str | Path,
    context: ParallelContext,
    *,
    files: list[Path],
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> None:
    """Write the weights of ``chunks`` as an HF folder (collective over the world): each stage's
    first TP rank of data-parallel replica 0 writes its export buckets as shards of at most
    ``max_shard_bytes``, and (a mixture-of-experts model) each rank of expert data-parallel rank
    0 the experts it holds; ``files`` (config, tokenizer...) are copied."""
    with staged_folder(out_folder, overwrite=overwrite) as staging:
        written: list[tuple[int, int, int, str, list[str], int]] = []
        dense = context.dp_rank == 0 and context.cp_rank == 0
        experts = model.is_moe and context.edp_rank == 0
        if dense or experts:
            # each bucket is written before the next is asked for: one kept buffer will do
            device = next(chunks[0].parameters()).device
            buckets = export_weights(
                chunks,
                model,
                context,
                version=0,
                bucket_bytes=max_shard_bytes,
                dtype=dtype,
                # collective over the TP group: only where the group exports dense tensors
                transport=make_transport("auto", context, device, False, reuse=True)
                if dense
                else "collective",
                dense=dense,
                experts=experts,
            )
            for bucket in tqdm(
                buckets,
                desc=f"Megatron -> HF (stage {context.pp_rank})",
                unit="shard",
                disable=not progress,
            ):
                expert = -1 if bucket.expert_rank is None else bucket.expert_rank
                part = "" if bucket.expert_rank is None else f"ep{bucket.expert_rank:03d}-"
                file = f"part-{bucket.pipeline_rank:05d}-{part}{bucket.index:05d}.safetensors"
                size = write_shard(staging / file, bucket.tensors)
                written.append(
                    (bucket.pipeline_rank, expert, bucket.index, file, list(bucket.tensors), size)
                )
        everyone: list[list] = [written]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, written)
        if _is_rank0():
            shards = sorted(entry for rank_written in everyone for entry in rank_written)
            name_shards(staging, [(file, names, size) for *_, file, names, size in shards])
            copy_files(files, staging)
            _set_config_dtype(staging / CONFIG_FILE, dtype)


def _set_config_dtype(config: Path, dtype: torch.dtype) -> None:
    """Make the ``dtype`` / ``torch_dtype`` fields of the copied config.json name the dtype the
    weights were written in (the file is left byte for byte unchanged when they already do)."""
    if not config.is_file():
        return
    hf = json.loads(config.read_text())
    keys = [key for key in ("dtype", "torch_dtype") if key in hf]
    if all(hf[key] == DTYPE_NAMES[dtype] for key in keys):
        return
    hf.update({key: DTYPE_NAMES[dtype] for key in keys})
    config.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")


def megatron_to_hf(
    checkpoint: str | Path,
    out_folder: str | Path,
    context: ParallelContext,
    *,
    dtype: str | None = None,
    hf_files_from: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = False,
) -> None:
    """Convert the Megatron checkpoint to an HF folder (collective), loading it at this layout.

    ``dtype``: of the HF weights; default: the dtype recorded at conversion from HF, else the
    checkpoint's. Config and tokenizer files come from the checkpoint's ``hf/`` folder, or from
    ``hf_files_from`` (an HF folder whose config.json must describe the same model).
    """
    check_apart(checkpoint, out_folder, "Megatron checkpoint")
    if hf_files_from is not None:
        check_apart(hf_files_from, out_folder, "folder of HF files")
    check_output(out_folder, overwrite)
    with output_locked(out_folder):
        _megatron_to_hf(
            Path(checkpoint),
            out_folder,
            context,
            dtype=dtype,
            hf_files_from=hf_files_from,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            progress=progress,
        )


def _megatron_to_hf(
    checkpoint: Path,
    out_folder: str | Path,
    context: ParallelContext,
    *,
    dtype: str | None,
    hf_files_from: str | Path | None,
    max_shard_bytes: int,
    overwrite: bool,
    progress: bool,
) -> None:
    """:func:`megatron_to_hf` once its output is checked and locked."""
    info = read_checkpoint_info(checkpoint)
    if hf_files_from is not None:
        source = Path(hf_files_from)
        found = read_model_config(source, params_dtype=info.model.params_dtype)
        check_same_model(info.model, found, f"HF config {source / CONFIG_FILE}")
    else:
        source = checkpoint / HF_FILES_DIR
        if not (source / CONFIG_FILE).is_file():
            raise ValueError(
                f"Megatron checkpoint {checkpoint} carries no HF config "
                f"({source / CONFIG_FILE}); pass the HF folder to take config and "
                "tokenizer files from"
            )
    name = dtype or info.hf_dtype or info.model.params_dtype
    if name not in _BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(_BY_NAME)}, got {name!r}")
    context = conversion_context(context, info.model)
    chunks = build_model(info.model, context.config, context, initialize=False)
    load_megatron_checkpoint(chunks, info.model, checkpoint)
    write_hf_folder(
        chunks,
        info.model,
        out_folder,
        context,
        files=non_weight_files(source),
        dtype=_BY_NAME[name],
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        progress=progress,
    )
