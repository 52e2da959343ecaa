"""Convert between Hugging Face checkpoint folders and Megatron distributed checkpoints.

    # one process (TP1/PP1), or any layout under torchrun (world size = TP x PP x DP)
    bapo-convert-checkpoint hf-to-megatron Qwen2.5-0.5B/ ckpt/qwen-0.5b
    torchrun --nproc-per-node 4 tools/convert_checkpoint.py hf-to-megatron \\
        Qwen2.5-0.5B/ ckpt/qwen-0.5b --tp 2 --pp 2
    bapo-convert-checkpoint megatron-to-hf ckpt/qwen-0.5b out/qwen-0.5b-hf
    # a mixture-of-experts model: experts over the ranks of each pipeline stage (EP x expert TP
    # must divide world size / PP)
    torchrun --nproc-per-node 8 tools/convert_checkpoint.py hf-to-megatron \\
        Qwen3-30B-A3B/ ckpt/qwen3-30b-a3b --tp 4 --ep 8

(``bapo-convert-checkpoint`` and ``python tools/convert_checkpoint.py`` are the same command.)

A Megatron checkpoint written at one layout loads at any other (resharding happens on load), so
``megatron-to-hf`` and the trainer may run at a layout different from the conversion's. Outputs
appear only once complete; the output's missing parent folders are created. The library code is
:mod:`bapo_megatron.weights.convert`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from bapo_megatron.files.unpickling_guard import refuse_unpickling_loads

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def byte_size(text: str) -> int:
    """``2GB``, ``512MiB``, ``1000`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("hf-to-megatron", help="HF folder -> Megatron checkpoint")
    to_megatron.add_argument("hf", help="HF folder: config.json, safetensors (+ index), tokenizer")
    to_megatron.add_argument("out", help="Megatron checkpoint folder to create")
    to_megatron.add_argument(
        "--params-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="dtype of the Megatron weights (default: the HF weights' if "
        "float32 or bfloat16, else float32)",
    )
    to_hf = commands.add_parser("megatron-to-hf", help="Megatron checkpoint -> HF folder")
    to_hf.add_argument("checkpoint", help="Megatron checkpoint folder")
    to_hf.add_argument("out", help="HF folder to create")
    to_hf.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the HF weights (default: that of the HF folder the "
        "checkpoint was converted from)",
    )
    to_hf.add_argument(
        "--hf-files-from",
        default=None,
        help="HF folder to take config.json and tokenizer files from (default: "
        "the copies stored in the checkpoint)",
    )
    to_hf.add_argument(
        "--max-shard-size",
        type=byte_size,
        default="2GB",
        help="largest safetensors shard (default 2GB)",
    )
    for command in (to_megatron, to_hf):
        command.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
        command.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
        command.add_argument(
            "--ep",
            type=int,
            default=1,
            help="expert-parallel size (mixture-of-experts models: each rank of a pipeline "
            "stage holds num_experts / EP experts)",
        )
        command.add_argument(
            "--etp",
            type=int,
            default=1,
            help="expert tensor-parallel size (mixture-of-experts models: ranks each expert's "
            "matrices are split over)",
        )
        command.add_argument(
            "--overwrite", action="store_true", help="replace the output folder if it exists"
        )
        command.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the command line ``argv`` (default: the process's arguments); exit code 2 on bad
    input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        refuse_unpickling_loads()  # megatron-to-hf loads a checkpoint
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Heavy imports here, not at the top: usage errors are answered before torch and Megatron
    # load, and a 'spawn' child re-importing the main module does not load them either.
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.distributed.context import ParallelContext
    from bapo_megatron.weights.convert import hf_to_megatron, megatron_to_hf

    layout = f"TP{args.tp}/PP{args.pp}" + (
        f"/EP{args.ep}/ETP{args.etp}" if (args.ep, args.etp) != (1, 1) else ""
    )
    try:
        # no sequence parallelism: it changes no weight (a mixture-of-experts model is built
        # with it where its layers need it, weights/convert.py conversion_context)
        context = ParallelContext.initialize(
            ParallelConfig(
                tensor_model_parallel_size=args.tp,
                pipeline_model_parallel_size=args.pp,
                expert_model_parallel_size=args.ep,
                expert_tensor_parallel_size=args.etp,
            )
        )
    except ValueError as err:  # a layout that does not fit the world size
        print(f"{parser.prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    progress = not args.no_progress
    # every rank may create them: mkdir with exist_ok tolerates a concurrent creation
    Path(args.out).absolute().parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.command == "hf-to-megatron":
            model, _ = hf_to_megatron(
                args.hf,
                args.out,
                context,
                params_dtype=args.params_dtype,
                overwrite=args.overwrite,
                progress=progress,
            )
            summary = (
                f"wrote Megatron checkpoint {args.out} ({model.model_type}, "
                f"{model.num_layers} layers, {model.params_dtype}) at {layout}"
            )
        else:
            megatron_to_hf(
                args.checkpoint,
                args.out,
                context,
                dtype=args.dtype,
                hf_files_from=args.hf_files_from,
                max_shard_bytes=args.max_shard_size,
                overwrite=args.overwrite,
                progress=progress,
            )
            summary = f"wrote HF folder {args.out} from {args.checkpoint} at {layout}"
        if context.rank == 0:
            print(summary, flush=True)
    except ValueError as err:  # bad input: the message names the file, tensor or field
        print(f"{parser.prog}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        context.teardown()
