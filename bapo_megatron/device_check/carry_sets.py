"""The package sets carried to the lent GPU machine (docs/gpu-checks.md), fetched with pip on a
machine that has it, and the commands a GPU session then runs.

- ``base``: megatron-core 0.16.1 and math-verify with its parser, in ``.whl/`` (3 MiB, travels
  whole with every check command).
- ``te``: Transformer Engine 2.11.0 (megatron-core 0.16.1 admits >= 2.9, < 2.12): the core
  library wheel for CUDA 13 (171 MiB), its Python package, the source of its PyTorch
  extension (built on the GPU machine against the image's torch: ``tools/gpu_install.sh``)
  and pydantic, which its Python code imports. Or, once a GPU session brought the built
  extension back, that wheel instead of the source (``--built``).
- ``vllm``: vLLM 0.26.0 (the last release pinning torch 2.11, the image's) without what a
  Hopper GPU does not load (:func:`vllm_slim`), and its Python dependencies the image lacks at
  the versions that imported there (newer xgrammar and fastapi broke the import), with the
  OpenAI server's.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bapo_megatron.device_check.carry import PART_BYTES, bundle_and_split, slim_wheel

PIP_BINARY = (
    "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
)
"""``pip download`` options for the GPU machine's Python 3.12 on x86-64, whatever this
machine runs (llguidance 1.7 is built for glibc 2.31 and newer only)."""
PYDANTIC = (
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
)
BASE = ("megatron-core==0.16.1", "math-verify==0.9.0", "latex2sympy2_extended==1.11.0",
        "antlr4-python3-runtime==4.13.2")
TE_WHEELS = ("transformer-engine-cu13==2.11.0", "transformer-engine==2.11.0", *PYDANTIC)
TE_BUILD_TOOLS = ("setuptools==84.2.1", "wheel==0.46.3")
"""What building the extension imports beside torch and packaging (its setup.py: setuptools,
``wheel.bdist_wheel``); the image may lack them, so they travel and are put on the build's
path only (``tools/gpu_install.sh``)."""
TE_SOURCE = "transformer-engine-torch==2.11.0"
VLLM = "vllm==0.26.0"
VLLM_DEPENDENCIES = (
    *PYDANTIC, "cbor2==6.3.0", "pyzmq==27.3.0", "msgspec==0.22.0", "pybase64==1.5.1",
    "cachetools==8.0.2", "partial-json-parser==0.2.1.1.post7", "openai==3.57.0",
    "httpx2==2.16.2", "httpcore2==2.16.2", "truststore==0.10.5", "sniffio==1.3.1",
    "openai-harmony==0.0.8", "fastapi==0.136.3", "starlette==1.10.0", "annotated-doc==0.0.7",
    "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10", "llguidance==1.7.6",
)
VLLM_SERVER = (
    "uvicorn==0.54.0", "watchfiles==1.3.0", "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0", "prometheus-fastapi-instrumentator==8.1.0",
)
SETS = ("base", "te", "vllm")
CUDA_STUB = (
    "# pip prepares transformer_engine_torch's metadata by running its setup.py, which reads\n"
    "# torch.version.cuda: None on a CPU-only torch. Only for that one pip download.\n"
    "import torch.version\n"
    "if torch.version.cuda is None:\n"
    "    torch.version.cuda = '13.0'\n"
)


def vllm_slim(name: str) -> bool:
    """Members of the vLLM wheel a Hopper GPU on Python 3.12 never loads: the FlashAttention-2
    library (124 MiB compressed; Hopper runs FlashAttention-3, and vLLM imports FA2 inside a
    try), the ``vllm-rs`` binary, and DeepGEMM's builds for other Pythons. Found by pattern, so
    that a path that moved inside the wheel is still found (or nothing is dropped)."""
    base = name.rsplit("/", 1)[-1]
    if fnmatch.fnmatch(base, "_vllm_fa2_C*.so") or base == "vllm-rs":
        return True
    return (
        "/deep_gemm/" in name
        and fnmatch.fnmatch(base, "_C.cpython-3*.so")
        and not base.startswith("_C.cpython-312-")
    )


def pip_download(specs: tuple[str, ...], dest: Path, *extra: str, env: dict | None = None) -> None:
    """``python -m pip download`` of ``specs`` into ``dest``; ``CalledProcessError`` on failure."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", *extra, "-d", str(dest), *specs],
        check=True, env=env,
    )


def fetch_te_source(dest: Path) -> None:
    """The extension's source (an sdist only): ``pip download`` prepares its metadata with the
    local torch (no build isolation: that would fetch a CUDA torch), with a stand-in CUDA
    version where the local torch is a CPU build (:data:`CUDA_STUB`)."""
    with tempfile.TemporaryDirectory(prefix="te-stub-") as stub:
        Path(stub, "sitecustomize.py").write_text(CUDA_STUB)
        env = {**os.environ, "NVTE_FRAMEWORK": "pytorch",
               "PYTHONPATH": os.pathsep.join(filter(None, [stub, os.environ.get("PYTHONPATH")]))}
        pip_download((TE_SOURCE,), dest, "--no-deps", "--no-build-isolation", "--no-binary",
                     TE_SOURCE.split("==")[0], env=env)


def fetch_set(name: str, download: Path, *, built: Path | None = None) -> list[Path]:
    """Download set ``name`` into the fresh folder ``download`` (vLLM's wheel slimmed) and
    return its files. ``built``: a ``transformer_engine_torch`` wheel built on the GPU machine,
    carried instead of the source."""
    if download.exists():
        shutil.rmtree(download)
    download.mkdir(parents=True)
    if name == "base":
        pip_download(BASE, download, *PIP_BINARY)
    elif name == "te":
        pip_download(TE_WHEELS, download, *PIP_BINARY)
        if built is not None:
            shutil.copy2(built, download / built.name)
        else:
            fetch_te_source(download)
            pip_download(TE_BUILD_TOOLS, download, *PIP_BINARY)
    elif name == "vllm":
        pip_download((VLLM, *VLLM_DEPENDENCIES, *VLLM_SERVER), download, *PIP_BINARY)
        [wheel] = download.glob("vllm-*.whl")
        slim = download / "slim"
        slim.mkdir()
        dropped = slim_wheel(wheel, slim / wheel.name, vllm_slim)
        if not any(fnmatch.fnmatch(d, "*_vllm_fa2_C*.so") for d in dropped):
            raise RuntimeError(f"{wheel.name}: no FlashAttention-2 library found to drop")
        print(f"{wheel.name}: dropped {dropped}", file=sys.stderr)
        wheel.unlink()
        (slim / wheel.name).replace(wheel)
        slim.rmdir()
    else:
        raise ValueError(f"unknown set {name!r}; the sets are {list(SETS)}")
    return sorted(p for p in download.iterdir() if p.is_file())


def prepare(name: str, out_root: Path, *, built: Path | None = None,
            part_bytes: int = PART_BYTES) -> list[Path]:
    """Fetch set ``name`` and split it into part folders under ``out_root`` (``base``: the
    folder ``.whl`` beside ``out_root``, no parts); returns the folders to carry."""
    if name == "base":
        fetch_set(name, out_root.parent / ".whl")
        return [out_root.parent / ".whl"]
    files = fetch_set(name, out_root / f"{name}.download", built=built)
    return bundle_and_split(name, files, out_root, part_bytes)


def gpu_commands(name: str, folders: list[Path], root: Path) -> list[tuple[str, list[str]]]:
    """``(command, paths to carry)`` per command of a GPU session, in order: one per part
    (copied out of the checkout to /root/parts), then the pass itself with the last part and
    ``.whl``, which joins, installs (and, for ``te``, builds) and runs the checks."""
    carried = [str(f.relative_to(root)) for f in folders]
    stash = "PYTHONPATH=. python3 tools/gpu_parts.py stash {}"
    commands = [(stash.format(path), [path]) for path in carried[:-1]]
    final = f"{stash.format(carried[-1])} && GPU_PASS={name} bash tools/gpu_check.sh \"$OUT\""
    commands.append((final, [carried[-1], ".whl"]))
    return commands
