"""Plan a recipe's layout rank by rank: validate it, build every simulated rank's shard on the
meta device, check the export plan and put each GPU's memory against its capacity.

Ranks of one data-parallel replica hold every distinct model shard (the other replicas hold the
same shards), so by default one replica is simulated: the ranks at data-parallel rank 0, one per
pipeline stage and tensor-parallel rank; ``all_ranks`` simulates the whole world. Memory is then
evaluated for every rank of the world: a replica's shards, each data-parallel rank's share of the
distributed optimizer, and the engine on the GPUs that host one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bapo_megatron.config import Config, ModelConfig
from bapo_megatron.distributed.layout import Accelerator, validate_layout
from bapo_megatron.planning.activations import ActivationShape, Attention, stage_bytes
from bapo_megatron.planning.engine_memory import COLOCATED, engine_memory, engine_ranks
from bapo_megatron.planning.export_coverage import ExportCoverage, check_export
from bapo_megatron.planning.shard_memory import actor_state_bytes
from bapo_megatron.planning.simulated_rank import build_meta_shard, megatron_rank, simulated_rank
from bapo_megatron.weights.name_maps import name_map_for

GB = 10**9
H100 = Accelerator(transformer_engine=True, cuda=True, fp8_gpu=True)


@dataclass(frozen=True)
class RankMemory:
    """One GPU's memory, in bytes."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    weights: int
    gradients: int
    optimizer: int
    optimizer_replicated: int
    optimizer_distributed: int
    activations: int
    engine_weights: int = 0
    engine_kv_cache: int = 0
    engine_budget: int = 0
    engine_kv_tokens: int = 0
    total: int = 0

    def as_gb(self) -> dict[str, float]:
        """Byte fields in GB (1e9 bytes), rounded to 0.01."""
        return {
            k: round(v / GB, 2) if k not in ("rank", "pp_rank", "tp_rank", "dp_rank") else v
            for k, v in dataclasses.asdict(self).items()
            if k != "engine_kv_tokens"
        } | {"engine_kv_tokens": self.engine_kv_tokens}


@dataclass
class LayoutPlan:
    """What the planner found; :attr:`problems` empty means the recipe passes."""

    world_size: int
    data_parallel_size: int = 0
    gpu_bytes: int = 0
    simulated_ranks: list[int] = field(default_factory=list)
    parameters_per_rank: dict[int, int] = field(default_factory=dict)
    model_parameters: int = 0
    export: ExportCoverage | None = None
    memory: list[RankMemory] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankMemory | None:
        """The rank with the most memory."""
        return max(self.memory, key=lambda m: m.total, default=None)

    def summary(self) -> dict[str, Any]:
        """The plan as one JSON-able object."""
        worst = self.worst
        return {
            "ok": not self.problems,
            "problems": self.problems,
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "gpu_memory_gb": round(self.gpu_bytes / GB, 2),
            "simulated_ranks": self.simulated_ranks,
            "model_parameters": self.model_parameters,
            "parameters_per_rank": {str(k): v for k, v in self.parameters_per_rank.items()},
            "export": None
            if self.export is None
            else {
                "complete": self.export.complete,
                "hf_tensors": self.export.tensors,
                "buckets": self.export.buckets,
                "missing": self.export.missing[:10],
                "duplicated": self.export.duplicated[:10],
                "wrong_shape": self.export.wrong_shape[:10],
            },
            "worst_rank_memory_gb": None if worst is None else worst.as_gb(),
        }


def plan_layout(
    config: Config,
    model: ModelConfig,
    world_size: int,
    *,
    gpu_bytes: int = 80 * GB,
    accelerator: Accelerator = H100,
    prompt_tokens: int = 1024,
    attention: Attention = "flash",
    all_ranks: bool = False,
) -> LayoutPlan:
    """Check ``config``'s layout of ``model`` over ``world_size`` GPUs of ``gpu_bytes`` each
    (sequences of ``prompt_tokens`` + ``rollout.max_new_tokens``); never raises for a layout
    that does not fit, but lists why in :attr:`LayoutPlan.problems`."""
    plan = LayoutPlan(world_size=world_size, gpu_bytes=gpu_bytes)
    parallel = config.parallel
    try:
        plan.data_parallel_size = dp = validate_layout(model, parallel, world_size, accelerator)
    except ValueError as err:
        plan.problems.append(f"layout: {err}")
        return plan
    if model.is_moe:
        plan.problems.append(
            f"model.model_type {model.model_type!r}: the planner does not model "
            "mixture-of-experts layers yet (expert shards per expert-parallel rank, their "
            "optimizer state over the expert data-parallel group, dispatcher buffers)"
        )
        return plan
    if parallel.context_parallel_size > 1:
        plan.problems.append(
            f"parallel.context_parallel_size={parallel.context_parallel_size}: the planner does "
            "not model context parallelism"
        )
        return plan
    shards: dict[int, dict[int, list]] = {}
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    replica = sorted(
        megatron_rank(parallel, world_size, t, 0, p) for t in range(tp) for p in range(pp)
    )
    for rank in range(world_size) if all_ranks else replica:
        with simulated_rank(parallel, world_size, rank) as context:
            expected = megatron_rank(
                parallel, world_size, context.tp_rank, context.dp_rank, context.pp_rank
            )
            if expected != rank:  # the rank arithmetic below relies on Megatron's order
                raise RuntimeError(f"Megatron placed rank {rank} at {expected}'s coordinates")
            chunks = build_meta_shard(model, parallel, context)
            plan.simulated_ranks.append(rank)
            plan.parameters_per_rank[rank] = sum(p.numel() for c in chunks for p in c.parameters())
            if context.dp_rank == 0:
                shards.setdefault(context.pp_rank, {})[context.tp_rank] = chunks
    plan.model_parameters = sum(
        _numel(shape) for shape in name_map_for(model.model_type).hf_shapes(model).values()
    )
    plan.export = check_export(shards, model, config.rollout.weight_bucket_mib * 2**20)
    if not plan.export.complete:
        plan.problems.append(
            f"export: missing {plan.export.missing[:5]}, duplicated {plan.export.duplicated[:5]}, "
            f"wrong shapes {plan.export.wrong_shape[:5]}"
        )
    _plan_memory(plan, config, model, shards, dp, prompt_tokens, attention)
    return plan


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _plan_memory(plan, config, model, shards, dp, prompt_tokens, attention) -> None:
    parallel, rollout = config.parallel, config.rollout
    world = plan.world_size
    sequences = rollout.prompts_per_step * rollout.samples_per_prompt
    per_rank = -(-sequences // (dp * config.algorithm.optimizer_steps_per_rollout))
    shape = ActivationShape(
        micro_batch_size=config.actor.micro_batch_size,
        sequence_length=prompt_tokens + rollout.max_new_tokens,
        micro_batches=-(-per_rank // config.actor.micro_batch_size),
        attention=attention,
    )
    layers = model.num_layers // parallel.pipeline_model_parallel_size
    colocated = rollout.engine in COLOCATED
    firsts = [megatron_rank(parallel, world, 0, d, 0) for d in range(dp)]
    hosts = engine_ranks(firsts, rollout.engine_tensor_parallel_size) if colocated else set()
    short: dict[str, list[int]] = {}  # engine problem -> the ranks that have it
    for rank in range(world):
        tp_rank = rank % parallel.tensor_model_parallel_size
        rest = rank // (parallel.tensor_model_parallel_size * parallel.context_parallel_size)
        dp_rank, pp_rank = rest % dp, rest // dp
        state = actor_state_bytes(
            shards[pp_rank][tp_rank], dp, dp_rank, config.optimizer.use_distributed_optimizer
        )
        activations = stage_bytes(model, parallel, shape, pp_rank, layers)
        memory = RankMemory(
            rank=rank,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            weights=state.weights,
            gradients=state.gradients,
            optimizer=state.optimizer,
            optimizer_replicated=state.optimizer_replicated,
            optimizer_distributed=state.optimizer_distributed,
            activations=activations,
        )
        total = state.total + activations
        if rank in hosts:
            engine = engine_memory(
                model,
                rollout,
                plan.model_parameters,
                plan.gpu_bytes,
                state.total,
                model.max_position_embeddings,
            )
            if rollout.engine == "vllm":
                engine_part = engine.budget
            else:  # SGLang's fraction holds the actor's state too; the engine's weights at least
                engine_part = max(engine.budget - state.total, engine.weights)
            if rollout.release_memory_during_training:
                total = state.total + max(activations, engine_part)
            else:
                total += engine_part
            memory = dataclasses.replace(
                memory,
                engine_weights=engine.weights,
                engine_kv_cache=engine.kv_cache,
                engine_budget=engine.budget,
                engine_kv_tokens=engine.kv_tokens,
            )
            if engine.kv_tokens < engine.context_tokens:
                short.setdefault(
                    f"the {rollout.engine} engine's KV cache holds "
                    f"{engine.kv_tokens} tokens ({engine.kv_cache / GB:.2f} GB = budget "
                    f"{engine.budget / GB:.2f} GB - weights {engine.weights / GB:.2f} GB"
                    + (
                        f" - actor state {state.total / GB:.2f} GB"
                        if rollout.engine == "sglang"
                        else ""
                    )
                    + f"), fewer than one {engine.context_tokens}-token sequence "
                    "(rollout.gpu_memory_utilization)",
                    [],
                ).append(rank)
        memory = dataclasses.replace(memory, total=total)
        plan.memory.append(memory)
    plan.problems += [f"ranks {ranks}: {problem}" for problem, ranks in short.items()]
    worst = plan.worst
    if worst is not None and worst.total > plan.gpu_bytes:
        plan.problems.append(
            f"memory: rank {worst.rank} (pipeline stage {worst.pp_rank}, TP rank "
            f"{worst.tp_rank}) needs {worst.total / GB:.2f} GB > {plan.gpu_bytes / GB:.2f} GB "
            f"per GPU: weights {worst.weights / GB:.2f} + gradients {worst.gradients / GB:.2f} + "
            f"optimizer {worst.optimizer / GB:.2f} + activations {worst.activations / GB:.2f}"
            + (
                f" + engine {(worst.total - worst.weights - worst.gradients - worst.optimizer - worst.activations) / GB:.2f}"  # noqa: E501
                if worst.engine_budget
                else ""
            )
            + " GB"
        )
