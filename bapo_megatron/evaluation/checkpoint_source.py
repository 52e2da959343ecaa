"""Which checkpoint an evaluation reads, and how its rollout engine is opened on it: an HF
folder as it is, or a Megatron checkpoint (a weights checkpoint or a run's newest trainer
checkpoint) through a one-process actor whose live export feeds the engine, or an HF folder
converted from it for the engines that load folders."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from bapo_megatron.actor.model import build_model
from bapo_megatron.config import ModelConfig, ParallelConfig, RolloutConfig
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import RolloutEngine
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.trainer.checkpoint import latest_checkpoint
from bapo_megatron.weights.convert import megatron_to_hf
from bapo_megatron.weights.export import export_weights, named_tensors_of
from bapo_megatron.weights.hf_checkpoint import copy_files, non_weight_files
from bapo_megatron.weights.megatron_checkpoint import (
    HF_FILES_DIR,
    INFO_FILE,
    load_megatron_checkpoint,
    read_checkpoint_info,
)

ENGINES = ("embedded", "vllm", "sglang")
"""Engines an evaluation can run on."""


@dataclass(frozen=True)
class CheckpointSource:
    """Where the policy's weights come from."""

    kind: str
    """`hf` or `megatron`."""
    path: Path
    """The HF folder, or the Megatron checkpoint folder (a run's latest step, resolved)."""
    files: Path | None
    """The folder of config, tokenizer and generation-config files that came with the weights
    (the HF folder, or a Megatron checkpoint's ``hf/``), or None."""


def resolve_checkpoint(path: str | Path) -> CheckpointSource:
    """Tell an HF folder from a Megatron checkpoint (or a trainer's checkpoint root, whose
    latest complete step is taken); ``ValueError`` for anything else."""

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a folder")
    if (path / "config.json").is_file():
        return CheckpointSource("hf", path, path)
    if not (path / INFO_FILE).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(
                f"checkpoint {path}: neither an HF folder (config.json), a Megatron "
                f"checkpoint ({INFO_FILE}) nor a run's checkpoint root (step_*)"
            )
        path = latest
    files = path / HF_FILES_DIR
    return CheckpointSource("megatron", path, files if files.is_dir() else None)


def model_config(source: CheckpointSource):
    """The checkpoint's :class:`~bapo_megatron.config.ModelConfig`, read from its files only.
    For an HF folder, ``params_dtype`` is bfloat16 when its weights are 16-bit (what vLLM and
    SGLang then run in), else float32."""

    if source.kind == "megatron":
        return read_checkpoint_info(source.path).model
    try:
        hf = json.loads((source.path / "config.json").read_text())
        dtype = hf.get("torch_dtype") or hf.get("dtype")
    except (json.JSONDecodeError, AttributeError):
        dtype = None  # from_hf_config names what is wrong with the file
    return ModelConfig.from_hf_config(
        source.path, params_dtype="bfloat16" if dtype in ("bfloat16", "float16") else "float32"
    )


def load_tokenizer(source: CheckpointSource, tokenizer_dir: str | Path | None):
    """The tokenizer of ``tokenizer_dir``, else the one stored with the checkpoint."""

    folder = Path(tokenizer_dir) if tokenizer_dir is not None else source.files
    if folder is None:
        raise ValueError(
            f"checkpoint {source.path} carries no tokenizer files (no hf/ folder, as "
            "in trainer checkpoints): pass the tokenizer's folder (--tokenizer)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot load a tokenizer from {folder} ({err}); pass --tokenizer"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer of {folder} has no eos token")
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer of {folder} has no chat template; prompts are put in it")
    return tokenizer


def stop_tokens(tokenizer, source: CheckpointSource) -> tuple[int, ...]:
    """The tokenizer's eos and the generation config's eos tokens (Qwen's chat models end a turn
    with one and the text with another)."""
    ids = {int(tokenizer.eos_token_id)}
    config = source.files / "generation_config.json" if source.files is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(int(t) for t in (eos if isinstance(eos, list) else [eos]))
    return tuple(sorted(ids))


@contextlib.contextmanager
def _one_process(context) -> Iterator[Any]:
    """``context``, or a one-process ParallelContext for the duration of the block."""
    if context is not None:
        yield context
        return

    context = ParallelContext.initialize(ParallelConfig())
    try:
        yield context
    finally:
        context.teardown()


def open_engine(
    source: CheckpointSource,
    kind: str,
    *,
    pad_token_id: int,
    work_dir: Path,
    tokenizer_dir: str | Path | None = None,
    max_model_len: int | None = None,
    engine_tp: int = 1,
    gpu_memory_utilization: float = 0.85,
    context=None,
) -> RolloutEngine:
    """An engine of ``kind`` holding the checkpoint's weights as policy version 0.

    The embedded engine runs in float32. A Megatron checkpoint is loaded in this process (in
    ``context``, else a one-process context built and torn down here) and exported into the
    embedded engine, or written to an HF folder under ``work_dir`` for vLLM/SGLang, which load
    from disk and size their KV cache for ``max_model_len`` tokens (default: the model's
    positions).
    """

    if kind not in ENGINES:
        raise ValueError(f"engine must be one of {list(ENGINES)}, got {kind!r}")
    model = model_config(source)
    if source.kind == "hf":
        if kind == "embedded":
            return EmbeddedEngine.from_pretrained(source.path, pad_token_id=pad_token_id)
        folder = source.path
    else:
        with _one_process(context) as ctx:
            if kind == "embedded":
                chunks = build_model(model, ctx.config, ctx, initialize=False)
                load_megatron_checkpoint(chunks, model, source.path)
                engine = EmbeddedEngine(
                    dataclasses.replace(model, params_dtype="float32"), pad_token_id=pad_token_id
                )
                buckets = export_weights(chunks, model, ctx, version=0)
                engine.update_weights(list(named_tensors_of(buckets)), version=0)
                return engine
            folder = work_dir / "hf"
            files = (
                None
                if source.files is not None and (source.files / "config.json").is_file()
                else _hf_files(model, tokenizer_dir, work_dir / "hf_files")
            )
            megatron_to_hf(source.path, folder, ctx, hf_files_from=files)

    rollout = RolloutConfig(
        engine=kind,
        engine_tensor_parallel_size=engine_tp,
        gpu_memory_utilization=gpu_memory_utilization,
    )
    if max_model_len is not None:  # the factory sizes vLLM's context from the model's positions
        model = dataclasses.replace(
            model, max_position_embeddings=min(max_model_len, model.max_position_embeddings)
        )
    return build_engine(
        rollout,
        model,
        model_path=str(folder),
        dp_rank=0,
        work_dir=work_dir,
        pad_token_id=pad_token_id,
    )


def _hf_files(model, tokenizer_dir: str | Path | None, out: Path) -> Path:
    """A folder with config.json written from ``model`` and the tokenizer folder's files, for
    converting a checkpoint that carries no HF files (trainer checkpoints)."""

    out.mkdir(parents=True)
    if tokenizer_dir is not None:
        copy_files([p for p in non_weight_files(tokenizer_dir) if p.name != "config.json"], out)
    (out / "config.json").write_text(json.dumps(model.to_hf_config(), indent=2) + "\n")
    return out


# ------------------------------------------------------------------------ the whole run
