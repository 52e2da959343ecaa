"""``bapo-plan-layout RECIPE.yaml --world-size N [dotted.key=value ...]``: check a recipe's layout
rank by rank without a GPU (:func:`bapo_megatron.planning.plan.plan_layout`).

Prints the layout (and for a mixture-of-experts model its expert layout), the distinct
parameters of all shards, the parameters (and experts) of each simulated rank, the export check
the memory of the fullest GPU, with optimizer offload the host memory per rank and per node, the
weight sync's bytes per trainer and engine rank and its messages, broadcast and shard-to-shard
(:mod:`bapo_megatron.planning.weight_traffic`), and the command that converts the model to a
Megatron checkpoint at the recipe's layout (:mod:`bapo_megatron.planning.conversion`); the last
line is one JSON object with all of it.
Exits 1 when the recipe does not pass (the reasons, with the numbers, are printed and in the JSON's
``problems``), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from bapo_megatron.config import ModelConfig, check_training
from bapo_megatron.config.loading import load_config
from bapo_megatron.planning.conversion import conversion_command
from bapo_megatron.planning.plan import GB, plan_layout
from bapo_megatron.planning.weight_traffic import weight_traffic


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bapo-plan-layout", description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="run configuration YAML")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--world-size", type=int, required=True, help="GPUs of the job")
    parser.add_argument(
        "--hf-config",
        help="the model's config.json (default: train.model_path's, or the model section)",
    )
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="per GPU (H100: 80)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=1024, help="prompt tokens before max_new_tokens"
    )
    parser.add_argument(
        "--attention",
        choices=("flash", "sdpa"),
        default="flash",
        help="activation model: Transformer Engine's fused attention (GPU) or the local spec's "
        "(torch SDPA: the CPU, or a GPU without Transformer Engine)",
    )
    parser.add_argument(
        "--all-ranks", action="store_true", help="simulate every rank, not one replica"
    )
    parser.add_argument(
        "--expert-load",
        type=float,
        default=1.0,
        help="MoE: token copies of the fullest rank's experts over the mean (1: balanced routing; "
        "the trainer logs it as moe/expert_load_max_over_mean)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="to sum the offloaded optimizer state's host memory per node",
    )
    parser.add_argument(
        "--engine-tp",
        type=int,
        help="weight sync: vLLM workers per engine replica (default: "
        "rollout.engine_tensor_parallel_size)",
    )
    parser.add_argument(
        "--engine-replicas",
        type=int,
        help="weight sync: engine replicas (default: one per model replica)",
    )
    return parser


def _model(config, hf_config: str | None) -> ModelConfig:
    train = config.train
    source = hf_config or train.model_path
    if source is None:
        if config.model is None:
            raise ValueError("the recipe has neither train.model_path nor a model section")
        return config.model
    overrides = {"params_dtype": train.params_dtype or "float32"}
    if train.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = train.max_position_embeddings
    return ModelConfig.from_hf_config(source, **overrides)


def main(argv: list[str] | None = None) -> int:
    """Run the planner; the exit code says whether the recipe passes."""
    args = _parser().parse_intermixed_args(argv)
    try:
        config = load_config(args.recipe, args.overrides)
        check_training(config)
        model = _model(config, args.hf_config)
        if args.world_size < 1 or args.gpu_memory_gb <= 0 or args.prompt_tokens < 1:
            raise ValueError("--world-size, --gpu-memory-gb and --prompt-tokens must be positive")
        if not args.expert_load >= 1:
            raise ValueError(f"--expert-load must be at least 1, got {args.expert_load}")
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be positive, got {args.gpus_per_node}")
        for flag in ("engine_tp", "engine_replicas"):
            if getattr(args, flag) is not None and getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    except ValueError as err:
        print(f"bapo-plan-layout: {err}", file=sys.stderr)
        print(json.dumps({"ok": False, "problems": [str(err)]}))
        return 2
    plan = plan_layout(
        config,
        model,
        args.world_size,
        gpu_bytes=int(args.gpu_memory_gb * GB),
        prompt_tokens=args.prompt_tokens,
        attention=args.attention,
        all_ranks=args.all_ranks,
        expert_load=args.expert_load,
        gpus_per_node=args.gpus_per_node,
    )
    summary = plan.summary()
    p = config.parallel
    print(
        f"layout: world {args.world_size} = TP {p.tensor_model_parallel_size} x PP "
        f"{p.pipeline_model_parallel_size} x DP {plan.data_parallel_size}; model "
        f"{plan.model_parameters} parameters ({model.model_type}, {model.params_dtype})"
    )
    if model.is_moe:
        print(
            f"experts: {model.moe.num_experts} per MoE layer over EP "
            f"{p.expert_model_parallel_size} x expert TP {p.expert_tensor_parallel_size} x "
            f"expert DP {plan.expert_data_parallel_size} per stage; "
            f"{p.moe_token_dispatcher} dispatcher"
        )
    print(f"shards: {plan.shard_parameters} distinct parameters")
    for rank, count in plan.parameters_per_rank.items():
        experts = plan.expert_parameters_per_rank.get(rank)
        print(
            f"rank {rank}: {count} parameters"
            + (f" ({experts} of them experts)" if experts is not None else "")
        )
    if plan.export is not None:
        print(
            f"export: {plan.export.tensors} HF tensors in {plan.export.buckets} buckets, "
            f"{'each exactly once with its full shape' if plan.export.complete else 'INCOMPLETE'}"
        )
    worst = summary["worst_rank_memory_gb"]
    if worst is not None:
        print("fullest GPU (GB): " + ", ".join(f"{k} {v}" for k, v in worst.items()))
    nodes = summary["host_optimizer_gb_per_node"]
    if any(nodes):
        most = max(m.optimizer_host for m in plan.memory) / GB
        print(
            f"host memory (optimizer.cpu_offload_fraction={config.optimizer.cpu_offload_fraction}"
            f"): up to {most:.2f} GB per rank, {max(nodes):.2f} GB on the fullest node of "
            f"{args.gpus_per_node} GPUs (half of it pinned), beside the processes' own memory"
        )
    if plan.placements and not plan.problems:
        summary["weight_sync"] = _print_weight_traffic(config, model, args, plan)
    command = summary["conversion_command"] = conversion_command(config, args.gpus_per_node)
    print(f"convert (optional; the trainer reads the HF folder itself): {command}")
    for problem in plan.problems:
        print(f"REFUSED: {problem}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if not plan.problems else 1


def _print_weight_traffic(config, model: ModelConfig, args, plan) -> dict:
    """Print the weight sync's traffic per rank, both paths; its JSON summary."""
    engine_tp = args.engine_tp or config.rollout.engine_tensor_parallel_size
    replicas = args.engine_replicas or plan.data_parallel_size
    traffic = weight_traffic(
        model,
        config.parallel,
        args.world_size,
        plan.placements,
        engine_tp,
        replicas,
        config.rollout.weight_bucket_mib * 2**20,
    )
    print(
        f"weight sync per update into {replicas} vLLM replica(s) of TP {engine_tp}: broadcast "
        f"{traffic.broadcast_messages} bucket broadcasts, every engine rank receives "
        f"{traffic.broadcast_received / GB:.3f} GB; shard-to-shard {traffic.messages} messages "
        f"(plan digest {traffic.digest[:12]})"
    )
    for rank in range(args.world_size):
        print(
            f"  trainer rank {rank} sends: broadcast "
            f"{traffic.broadcast_sent.get(rank, 0) / GB:.3f} GB, shard-to-shard "
            f"{traffic.sent.get(rank, 0) / GB:.3f} GB"
        )
    for rank, received in traffic.received.items():
        print(
            f"  engine rank {rank - args.world_size} receives: broadcast "
            f"{traffic.broadcast_received / GB:.3f} GB, shard-to-shard {received / GB:.3f} GB"
        )
    return traffic.summary()

