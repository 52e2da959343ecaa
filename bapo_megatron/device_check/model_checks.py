"""The device check's model-level check, in a process of its own: ``conversion``, an HF folder
written by transformers -> Megatron checkpoint -> HF folder on the device; the Megatron actor's
logits against transformers' own forward of the same folder on the same device, and the round
trip's tensors against the originals (bitwise). Reports the layer spec the model was built from
and how many of its parameters carry Transformer Engine's fused norm names (``linear_qkv`` /
``linear_fc1.layer_norm_weight``).

Run as ``python -m bapo_megatron.device_check.model_checks conversion --device D --json OUT ...``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from bapo_megatron.config import ParallelConfig
from bapo_megatron.device_check.passes import fused_norm_parameters, layer_spec_of
from bapo_megatron.device_check.shapes import model_config
from bapo_megatron.device_check.start_folder import write_start_folder
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.process.end import skip_final_collection
from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf


def conversion(args) -> dict:

    work = Path(args.work)
    model = model_config("small", cpu_sized=True)  # a 2-layer Qwen2: conversion, not scale
    hf_folder = write_start_folder(model, work / "hf", seed=3)
    context = ParallelContext.initialize(ParallelConfig(device=args.device))
    try:
        converted, chunks = hf_to_megatron(
            hf_folder, work / "megatron", context, params_dtype="float32"
        )
        tokens = torch.randint(
            0, model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
        ).to(context.device)
        positions = torch.arange(64, device=context.device).expand(2, 64)
        with torch.no_grad():
            ours = chunks[0](tokens, positions, None).float()
            reference = (
                transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
                .to(context.device)
                .eval()
            )
            theirs = reference(input_ids=tokens).logits.float()
        spec, fused = layer_spec_of(chunks), fused_norm_parameters(chunks)
        megatron_to_hf(work / "megatron", work / "hf_back", context)
    finally:
        context.teardown()
    original = {}
    for path in sorted(hf_folder.glob("*.safetensors")):
        original.update(load_file(path))
    back = {}
    for path in sorted((work / "hf_back").glob("*.safetensors")):
        back.update(load_file(path))
    mismatched = sorted(
        name for name in original if name not in back or not torch.equal(original[name], back[name])
    )
    diff = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    return {
        "status": "passed" if diff <= 1e-4 * max(1.0, scale) and not mismatched else "failed",
        "model": f"{converted.model_type}, {converted.num_layers} layers, hidden "
        f"{converted.hidden_size}, vocab {converted.vocab_size}",
        "logits_max_abs_diff_vs_transformers": diff,
        "logits_max_abs": scale,
        "tolerance": "1e-4 x max(1, max |logit|) (float32 on both sides; kernels differ)",
        "layer_spec": spec,
        "fused_norm_parameters": fused,
        "round_trip_tensors": len(original),
        "round_trip_mismatched": mismatched[:10],
    }


CHECKS = {"conversion": conversion}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--work", default=".")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    result = CHECKS[args.check](args)
    path = Path(args.json)
    path.with_suffix(".partial").write_text(json.dumps(result, indent=1))
    path.with_suffix(".partial").replace(path)


if __name__ == "__main__":
    main()
    skip_final_collection()
