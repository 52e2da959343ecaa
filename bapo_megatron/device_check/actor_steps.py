"""Train steps of the Megatron actor with the BAPO loss on one device, from a shared start, as
one process of the device check: each variant (clip preset x granularity, optionally the
distributed optimizer) loads the same HF weights, trains ``--steps`` steps on the same random
off-policy batch, and reports per step the loss, gradient norm, entropy and chosen bounds, the
step's tokens/s, a SHA-256 of the parameters after the last step (bitwise comparisons) and, on
CUDA, the memory of each component of the actor measured around the build and the first step
next to what the layout planner predicts for it.

Run as ``python -m bapo_megatron.device_check.actor_steps --device cuda --start FOLDER ...``;
the orchestrator (:mod:`bapo_megatron.device_check.run`) starts it once per device and
compares the JSON files.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from bapo_megatron.actor.actor import Actor
from bapo_megatron.actor.model import build_model
from bapo_megatron.actor.optimizer import build_optimizer, wrap_data_parallel
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
)
from bapo_megatron.device_check.passes import layer_spec_of
from bapo_megatron.device_check.shapes import model_config, random_batch
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.planning.activations import (
    DTYPE_BYTES,
    ActivationShape,
    moe_tokens,
    stage_bytes,
)
from bapo_megatron.planning.moe_memory import dispatcher_bytes
from bapo_megatron.planning.shard_memory import actor_state_bytes
from bapo_megatron.process.end import skip_final_collection
from bapo_megatron.weights.convert import load_hf_weights
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint

VARIANTS = ("paper/step", "paper/microbatch", "reference/step", "reference/microbatch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--start", help="HF folder the actor starts from")
    parser.add_argument(
        "--size", help="or: a model of device_check.shapes, random weights (memory check)"
    )
    parser.add_argument("--cpu-sized", action="store_true", help="with --size: its CPU variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--memory", action="store_true", help="measure memory per component")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--fp8", choices=("e4m3", "hybrid"), help="FP8 GEMMs (needs TE, a GPU)")
    parser.add_argument("--fp8-recipe", default="delayed", help="with --fp8: TE's scaling recipe")
    parser.add_argument("--json", required=True, help="where the results go")
    return parser.parse_args(argv)


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The one-rank layout of this process, with its FP8 mode (refused where it cannot run:
    ``parallel.fp8`` names the reason)."""
    return ParallelConfig(device=args.device, fp8=args.fp8, fp8_recipe=args.fp8_recipe)


def parameter_digest(actor) -> str:
    """SHA-256 over every parameter's bytes, in name order."""
    digest = hashlib.sha256()
    for name, param in sorted(actor.named_parameters().items()):
        digest.update(name.encode())
        data = param.detach().float().cpu().contiguous()
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_variant(args, variant: str, context, model, start: Path, batch) -> dict:

    preset, granularity = variant.split("/")
    clip = ClipSearchConfig.from_preset(preset, granularity=granularity)
    loss = LossConfig(clip=clip, aggregation="token-mean")
    device = context.device
    actor, marks = build_measured(args, model, context, initialize=start is None)
    if start is not None:
        with HFCheckpoint.open(start) as hf, torch.no_grad():
            load_hf_weights(actor.chunks, hf, context)
        actor.optimizer.reload_model_params()  # the fp32 main copies of bf16 weights
    plan = SearchPlan.from_config(clip)
    steps, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_base = _allocated(device)
    for _ in range(args.steps):
        _sync(device)
        began = time.perf_counter()
        metrics = train_step(actor, batch, loss, plan)
        _sync(device)
        times.append(time.perf_counter() - began)
        steps.append({k: float(v) for k, v in metrics.items()})
    result = {
        "variant": variant,
        "steps": steps,
        "step_seconds": times,
        "tokens_per_s": batch.tokens.numel() / min(times),
        "parameters_sha256": parameter_digest(actor),
        "layer_spec": layer_spec_of(actor.chunks),
    }
    if args.memory and device.type == "cuda":
        marks.update(before_step=step_base, after_steps=_allocated(device),
                     peak=torch.cuda.max_memory_allocated())
        result["memory"] = measured_vs_planned(actor, model, context, batch, args, marks)
    del actor
    return result


def build_measured(args, model, context, *, initialize: bool):
    """:func:`~bapo_megatron.actor.actor.build_actor`'s three parts one by one, with the bytes
    allocated after each (model weights, DDP gradient buffers, optimizer with its main copies)."""

    actor_config = ActorConfig(micro_batch_size=args.micro_batch_size, temperature=1.0, seed=1)
    optimizer_config = OptimizerConfig(
        lr=1e-5, weight_decay=0.0, clip_grad=1.0,
        use_distributed_optimizer=args.distributed_optimizer,
    )
    marks = {"before_build": _allocated(context.device)}
    chunks = build_model(model, context.config, context, seed=actor_config.seed,
                         initialize=initialize)
    marks["after_model"] = _allocated(context.device)
    wrapped = wrap_data_parallel(chunks, chunks[0].config, optimizer_config, context)
    marks["after_ddp"] = _allocated(context.device)
    optimizer, scheduler = build_optimizer(
        wrapped, optimizer_config, chunks[0].config.params_dtype, context
    )
    marks["after_optimizer"] = _allocated(context.device)
    actor = Actor(context=context, model_config=model, actor_config=actor_config,
                  optimizer_config=optimizer_config, chunks=wrapped, optimizer=optimizer,
                  scheduler=scheduler)
    return actor, marks


def measured_vs_planned(actor, model, context, batch, args, marks: dict[str, int]) -> dict:
    """Measured bytes per component next to the planner's (weights + gradient buffers at build,
    optimizer state after the first step, activations as the step's peak over its start)."""

    planned = actor_state_bytes(
        actor.chunks, context.dp_size, context.dp_rank, args.distributed_optimizer
    )
    shape = ActivationShape(
        micro_batch_size=args.micro_batch_size,
        sequence_length=batch.tokens.shape[1],
        micro_batches=-(-batch.tokens.shape[0] // args.micro_batch_size),
        attention="sdpa",
    )
    activations = stage_bytes(model, context.config, shape, 0, model.num_layers)
    if model.is_moe:  # the dispatcher's buffers are transient, so within the step's peak
        tokens = moe_tokens(context.config, shape)
        element = DTYPE_BYTES[model.params_dtype]
        activations += dispatcher_bytes(tokens, model, context.config, element)
    # Adam's moments appear at the first step; the main copies of bf16 weights with the
    # optimizer: both are the planner's "optimizer".
    measured = {
        "weights": marks["after_model"] - marks["before_build"],
        "gradients": marks["after_ddp"] - marks["after_model"],
        "optimizer": marks["after_optimizer"] - marks["after_ddp"]
        + marks["after_steps"] - marks["before_step"],
        "activations_peak": marks["peak"] - marks["after_steps"],
    }
    plan = {
        "weights": planned.weights,
        "gradients": planned.gradients,
        "optimizer": planned.optimizer,
        "activations_peak": activations,
    }
    measured["total"] = sum(measured.values())
    plan["total"] = sum(plan.values())
    return {
        "measured_bytes": measured,
        "planned_bytes": plan,
        "ratio_measured_over_planned": {
            k: (measured[k] / plan[k] if plan[k] else None) for k in plan
        },
        "marks": marks,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        # cuBLAS needs a fixed workspace for reproducible GEMMs, set before CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    if args.start:
        start = Path(args.start)
        model = dataclasses.replace(ModelConfig.from_hf_config(start), params_dtype=args.dtype)
    else:
        start, model = None, model_config(args.size, cpu_sized=args.cpu_sized, dtype=args.dtype)
    batch = random_batch(model.vocab_size, sequences=args.sequences, length=args.length, seed=7)
    context = ParallelContext.initialize(parallel_config(args))
    results = []
    try:
        for variant in args.variants.split(","):
            results.append(run_variant(args, variant, context, model, start, batch))
    finally:
        context.teardown()
    spec = results[0].pop("layer_spec") if results else None
    for result in results[1:]:
        result.pop("layer_spec")
    out = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "model": dataclasses.asdict(model),
        "tokens_per_step": int(batch.tokens.numel()),
        "response_tokens_per_step": int(batch.response_mask.sum()),
        "distributed_optimizer": args.distributed_optimizer,
        "deterministic": args.deterministic,
        "layer_spec": spec,
        "fp8": {"format": args.fp8, "recipe": args.fp8_recipe} if args.fp8 else None,
        "variants": results,
    }
    path = Path(args.json)
    path.with_suffix(".partial").write_text(json.dumps(out, indent=1))
    path.with_suffix(".partial").replace(path)


if __name__ == "__main__":
    main()
    skip_final_collection()
