"""The shared starting point of the device check's comparisons: an HF folder written once, so
that a GPU run and a CPU reference start from the same weights. Apart from
:mod:`~bapo_megatron.device_check.shapes` because it needs transformers, which the processes
that only train (:mod:`~bapo_megatron.device_check.actor_steps`) would otherwise import for
nothing (about 1.5 s of a CPU each)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from bapo_megatron.config import ModelConfig


def write_start_folder(model: ModelConfig, folder: Path, seed: int) -> Path:
    """An HF folder (config.json + safetensors, bfloat16 weights) with random weights drawn by
    transformers from ``seed``: bfloat16 so that a bfloat16 GPU actor and a float32 CPU actor
    load exactly the same numbers."""

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**model.to_hf_config())
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf.to(torch.bfloat16).save_pretrained(folder.with_suffix(".partial"))
    folder.rmdir()
    folder.with_suffix(".partial").rename(folder)
    return folder
