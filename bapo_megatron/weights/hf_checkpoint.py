"""Hugging Face checkpoint folders: read lazily and validated, written as safetensors shards.

A folder holds ``config.json``, the weights as ``model.safetensors`` or as shards listed in
``model.safetensors.index.json``, and other files (tokenizer, generation config, chat template)
that conversions carry along unchanged. :meth:`HFCheckpoint.open` checks everything it can from
the headers alone, before any tensor is read: the model type has a name map, the index is valid,
every shard exists and is complete, every tensor the config implies is present with the shape
it implies, and nothing else is. Errors are ``ValueError`` naming the file and the tensor.
Tensors are then read one at a time, or one tensor-parallel slice at a time, from memory-mapped
files (``safetensors.safe_open``), so a reader never holds more than the tensor it returns.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from bapo_megatron.config import ModelConfig
from bapo_megatron.files.atomic import new_file_mode
from bapo_megatron.models.name_maps import NameMap, name_map_for

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight files of other formats; a folder with only these is refused, and they are never copied.
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Non-parameter buffers some older checkpoints store; recomputed from the config.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_model_config(folder: str | Path, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the HF folder (or ``config.json``) ``folder``.

    ``overrides`` are passed to :meth:`ModelConfig.from_hf_config` (which also reads the
    transformers 5 ``rope_parameters`` form).
    """
    return ModelConfig.from_hf_config(folder, **overrides)


def _open_safetensors(path: Path, stack: contextlib.ExitStack) -> Any:
    try:
        return stack.enter_context(safe_open(str(path), framework="pt"))
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"HF checkpoint: weight file {path} cannot be read (missing, truncated "
            f"or not safetensors): {err}"
        ) from None


class HFCheckpoint:
    """A validated HF checkpoint folder, open for lazy reading. Use as a context manager (or
    call :meth:`close`); build with :meth:`open`."""

    def __init__(
        self,
        folder: Path,
        model: ModelConfig,
        name_map: NameMap,
        handles: dict[str, Any],
        locations: dict[str, str],
        dtype: torch.dtype,
        stack: contextlib.ExitStack,
    ) -> None:
        self.folder = folder
        """The checkpoint folder."""
        self.model = model
        """Architecture read from its ``config.json``."""
        self.name_map = name_map
        """The family's name map (registry entry of ``model.model_type``)."""
        self.dtype = dtype
        """The dtype every weight is stored in."""
        self._handles = handles  # file name -> open safe_open handle
        self._locations = locations  # tensor name -> file name
        self._stack = stack

    @classmethod
    def open(cls, folder: str | Path, **overrides: Any) -> HFCheckpoint:
        """Validate the folder from its config and the safetensors headers (nothing is loaded)
        and open it; ``overrides`` go to :func:`read_model_config` (e.g. ``params_dtype``)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"HF checkpoint folder {folder} does not exist")
        model = read_model_config(folder, **overrides)
        name_map = name_map_for(model.model_type)
        locations = _weight_locations(folder)
        stack = contextlib.ExitStack()
        try:
            handles = {
                name: _open_safetensors(folder / name, stack)
                for name in sorted(set(locations.values()))
            }
            dtype = _check_tensors(folder, model, name_map, handles, locations)
        except BaseException:
            stack.close()
            raise
        return cls(folder, model, name_map, handles, locations, dtype, stack)

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the memory maps."""
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._locations

    def read(self, name: str, dim: int | None = None, part: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``part`` of its dimension ``dim`` (read from the file without
        reading the rest)."""
        if name not in self._locations:
            raise KeyError(f"HF checkpoint {self.folder} has no tensor {name!r}")
        view = self._handles[self._locations[name]].get_slice(name)
        if dim is None:
            return view[:]
        index = (slice(None),) * dim + (part,)
        return view[index]


def _weight_locations(folder: Path) -> dict[str, str]:
    """Tensor name -> weight file name, from the index or the single file."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"HF checkpoint: {index_path} is not valid JSON: {err}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(
                f"HF checkpoint: {index_path} has no 'weight_map' object of "
                "tensor name -> file name"
            )
        for name, file in weight_map.items():
            if "/" in file or file.startswith("."):
                raise ValueError(
                    f"HF checkpoint: {index_path} puts tensor {name!r} in {file!r}, "
                    "which is not a file of the folder"
                )
            if not (folder / file).is_file():
                raise ValueError(
                    f"HF checkpoint: shard {folder / file} (listed in {INDEX_FILE} "
                    f"for tensor {name!r}) does not exist"
                )
        return dict(weight_map)
    if (folder / SINGLE_FILE).is_file():
        with contextlib.ExitStack() as stack:
            handle = _open_safetensors(folder / SINGLE_FILE, stack)
            return {name: SINGLE_FILE for name in handle.keys()}
    others = sorted(p.name for p in folder.iterdir() if p.suffix in OTHER_WEIGHT_SUFFIXES)
    if others:
        raise ValueError(
            f"HF checkpoint {folder}: only safetensors weights are supported, found {others}"
        )
    raise ValueError(f"HF checkpoint {folder}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")


def _check_tensors(
    folder: Path,
    model: ModelConfig,
    name_map: NameMap,
    handles: Mapping[str, Any],
    locations: Mapping[str, str],
) -> torch.dtype:
    """Every tensor is where the index says, with the shape the config implies; returns the
    common dtype."""
    in_file = {file: set(handle.keys()) for file, handle in handles.items()}
    for name, file in locations.items():
        if name not in in_file[file]:
            raise ValueError(
                f"HF checkpoint: {INDEX_FILE} puts tensor {name!r} in "
                f"{folder / file}, which does not contain it"
            )
    expected = name_map.hf_shapes(model)
    for name in expected:
        if name not in locations:
            raise ValueError(
                f"HF checkpoint {folder}: tensor {name!r} is missing (expected by "
                f"{CONFIG_FILE}: model_type {model.model_type!r}, "
                f"{model.num_layers} layers)"
            )
    dtypes: dict[str, torch.dtype] = {}
    for name, file in locations.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        view = handles[file].get_slice(name)
        if name in expected:
            want = expected[name]
        elif name == "lm_head.weight" and model.tie_word_embeddings:
            want = expected["model.embed_tokens.weight"]  # a stored copy of the tied matrix
        else:
            raise ValueError(
                f"HF checkpoint {folder / file}: unexpected tensor {name!r} for "
                f"{CONFIG_FILE} (model_type {model.model_type!r}, "
                f"{model.num_layers} layers, tie_word_embeddings="
                f"{model.tie_word_embeddings})"
            )
        shape = tuple(view.get_shape())
        if shape != want:
            raise ValueError(
                f"HF checkpoint {folder / file}: tensor {name!r} has shape {shape}, "
                f"but {CONFIG_FILE} implies {want}"
            )
        if view.get_dtype() not in _DTYPES:
            raise ValueError(
                f"HF checkpoint {folder / file}: tensor {name!r} has dtype "
                f"{view.get_dtype()}; expected one of {sorted(_DTYPES)}"
            )
        dtypes[name] = _DTYPES[view.get_dtype()]
    (dtype, _), *others = Counter(dtypes.values()).most_common()
    if others:
        odd = next(name for name, d in dtypes.items() if d != dtype)
        raise ValueError(
            f"HF checkpoint {folder}: tensor {odd!r} is {dtypes[odd]} while most are "
            f"{dtype}; checkpoints with mixed dtypes are not supported"
        )
    return dtype


def non_weight_files(folder: str | Path) -> list[Path]:
    """The files a conversion carries along unchanged: every top-level file of the folder except
    weights and their index (config, generation config, tokenizer files, chat template...)."""
    folder = Path(folder)
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix != ".safetensors"
        and p.name != INDEX_FILE
        and p.suffix not in OTHER_WEIGHT_SUFFIXES
    )


def copy_files(files: Iterable[Path], destination: Path) -> None:
    """Copy ``files`` byte for byte into the folder ``destination``."""
    for path in files:
        shutil.copyfile(path, destination / path.name)


def write_shard(path: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write one safetensors file (with transformers' ``format: pt`` metadata); returns its
    tensor bytes."""
    save_file(
        {name: t.contiguous() for name, t in tensors.items()}, str(path), metadata={"format": "pt"}
    )
    path.chmod(new_file_mode())  # safetensors writes through a private (0o600) temporary file
    return sum(t.numel() * t.element_size() for t in tensors.values())


def name_shards(folder: Path, shards: list[tuple[str, list[str], int]]) -> None:
    """Rename the written shard files ``shards`` (file name, its tensors, its bytes), in order, to
    HF's ``model-0000k-of-0000n.safetensors`` and write the index."""
    total = len(shards)
    weight_map: dict[str, str] = {}
    for k, (file, names, _) in enumerate(shards, start=1):
        final = f"model-{k:05d}-of-{total:05d}.safetensors"
        (folder / file).rename(folder / final)
        weight_map.update((name, final) for name in names)
    index = {
        "metadata": {"total_size": sum(size for *_, size in shards)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
