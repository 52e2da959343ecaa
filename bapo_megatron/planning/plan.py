"""Plan a recipe's layout rank by rank: validate it, build every simulated rank's shard on the
meta device, check the export plan and put each GPU's memory against its capacity.

Ranks of one data-parallel replica hold every distinct dense shard (the other replicas hold the
same shards), so by default one replica is simulated: the ranks at data-parallel rank 0, one per
pipeline stage and tensor-parallel rank. A mixture-of-experts model's experts are laid out by
Megatron's second decomposition of each stage (expert tensor x expert model x expert data
parallel), so the ranks at expert data-parallel rank 0 (every expert-parallel and expert
tensor-parallel rank of each stage) are simulated too; ``all_ranks`` simulates the whole world.
Memory is then evaluated for every rank of the world: its dense shard with its data-parallel
rank's share of the distributed optimizer, its expert shard with its expert data-parallel rank's
share (:mod:`~bapo_megatron.planning.moe_memory`), activations, the token dispatcher's buffers,
and the engine on the GPUs that host one; the optimizer state that
``optimizer.cpu_offload_fraction`` moves to the host is counted apart, per rank and per node. Two
checks hold the shards to the model: their distinct parameters add up to the name map's total,
and each rank's expert parameters equal the analytic count
(:func:`~bapo_megatron.planning.moe_memory.expert_parameters`).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bapo_megatron.config import Config, ModelConfig
from bapo_megatron.distributed.layout import Accelerator, validate_layout
from bapo_megatron.models.name_maps import name_map_for
from bapo_megatron.models.trainer_shards import ParamPlacement, chunk_placements
from bapo_megatron.planning.activations import (
    DTYPE_BYTES,
    Attention,
    moe_tokens,
    stage_bytes,
    training_shape,
)
from bapo_megatron.planning.engine_memory import COLOCATED, engine_memory, engine_ranks
from bapo_megatron.planning.export_coverage import ExportCoverage, check_export
from bapo_megatron.planning.moe_memory import (
    dispatcher_bytes,
    expert_data_parallel_size,
    expert_parameters,
    stage_moe_layers,
)
from bapo_megatron.planning.shard_count import distinct_parameters, expert_parameter_count
from bapo_megatron.planning.shard_memory import actor_state_bytes, offload_optimizer
from bapo_megatron.planning.simulated_rank import (
    build_meta_shard,
    expert_coordinates,
    expert_rank,
    megatron_rank,
    simulated_rank,
)

GB = 10**9
H100 = Accelerator(transformer_engine=True, cuda=True, fp8_gpu=True)


@dataclass(frozen=True)
class RankMemory:
    """One GPU's memory, in bytes; ``weights``, ``gradients`` and ``optimizer`` include the
    ``expert_*`` parts. ``optimizer`` and ``expert_optimizer`` are what stays on the GPU;
    ``optimizer_host``, the offloaded share's host memory, is not in ``total``."""

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
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0
    expert_weights: int = 0
    expert_gradients: int = 0
    expert_optimizer: int = 0
    dispatcher: int = 0
    engine_weights: int = 0
    engine_kv_cache: int = 0
    engine_budget: int = 0
    engine_kv_tokens: int = 0
    optimizer_host: int = 0
    reference_weights: int = 0
    """The KL term's frozen reference policy (``algorithm.kl``): its shard of the weights, the
    size of the actor's. Offloaded, it is on the GPU only for its forward pass."""
    reference_host: int = 0
    """The offloaded reference's weights in host memory (not in ``total``)."""
    total: int = 0

    def as_gb(self) -> dict[str, float]:
        """Byte fields in GB (1e9 bytes), rounded to 0.01."""
        return {
            k: v if k in _NOT_BYTES else round(v / GB, 2)
            for k, v in dataclasses.asdict(self).items()
        }


_NOT_BYTES = ("rank", "pp_rank", "tp_rank", "dp_rank", "ep_rank", "etp_rank", "edp_rank")
_NOT_BYTES += ("engine_kv_tokens",)


@dataclass
class LayoutPlan:
    """What the planner found; :attr:`problems` empty means the recipe passes."""

    world_size: int
    gpus_per_node: int = 8
    data_parallel_size: int = 0
    expert_data_parallel_size: int = 0
    gpu_bytes: int = 0
    simulated_ranks: list[int] = field(default_factory=list)
    parameters_per_rank: dict[int, int] = field(default_factory=dict)
    expert_parameters_per_rank: dict[int, int] = field(default_factory=dict)
    """Expert parameters of each simulated rank's meta shard (MoE models)."""
    model_parameters: int = 0
    shard_parameters: int = 0
    """Distinct parameters of all simulated shards together (each tensor once)."""
    export: ExportCoverage | None = None
    placements: dict[int, list[ParamPlacement]] = field(default_factory=dict)
    """Each simulated rank's parameters as its shard map reads them."""
    memory: list[RankMemory] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def worst(self) -> RankMemory | None:
        """The rank with the most memory."""
        return max(self.memory, key=lambda m: m.total, default=None)

    @property
    def host_bytes_per_node(self) -> list[int]:
        """Offloaded optimizer state of each node's ranks together (ranks fill nodes in order,
        :attr:`gpus_per_node` each, as torchrun numbers them)."""
        nodes = [0] * -(-self.world_size // self.gpus_per_node)
        for memory in self.memory:
            nodes[memory.rank // self.gpus_per_node] += memory.optimizer_host
        return nodes if self.memory else []

    def summary(self) -> dict[str, Any]:
        """The plan as one JSON-able object."""
        worst = self.worst
        return {
            "ok": not self.problems,
            "problems": self.problems,
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "expert_data_parallel_size": self.expert_data_parallel_size,
            "gpu_memory_gb": round(self.gpu_bytes / GB, 2),
            "simulated_ranks": self.simulated_ranks,
            "model_parameters": self.model_parameters,
            "shard_parameters": self.shard_parameters,
            "parameters_per_rank": {str(k): v for k, v in self.parameters_per_rank.items()},
            "expert_parameters_per_rank": {
                str(k): v for k, v in self.expert_parameters_per_rank.items()
            },
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
            "gpus_per_node": self.gpus_per_node,
            "host_optimizer_gb_per_node": [round(b / GB, 2) for b in self.host_bytes_per_node],
        }


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The shards stay alive until the plan is done: a large plan holds millions of module objects, and
# the collector's passes over them, which find nothing (the builds leave no cycles), were a quarter
# of the 235B recipe's plan.
@collector_paused()
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
    expert_load: float = 1.0,
    gpus_per_node: int = 8,
) -> LayoutPlan:
    """Check ``config``'s layout of ``model`` over ``world_size`` GPUs of ``gpu_bytes`` each
    (sequences of ``prompt_tokens`` + ``rollout.max_new_tokens``; ``expert_load``: the fullest
    rank's expert tokens over the mean, 1 = balanced routing; ``gpus_per_node``: to sum host
    memory per node); never raises for a layout that does not fit, but lists why in
    :attr:`LayoutPlan.problems`."""
    plan = LayoutPlan(world_size=world_size, gpu_bytes=gpu_bytes, gpus_per_node=gpus_per_node)
    parallel = config.parallel
    try:
        plan.data_parallel_size = dp = validate_layout(model, parallel, world_size, accelerator)
    except ValueError as err:
        plan.problems.append(f"layout: {err}")
        return plan
    plan.expert_data_parallel_size = expert_data_parallel_size(parallel, world_size)
    if parallel.context_parallel_size > 1:
        plan.problems.append(
            f"parallel.context_parallel_size={parallel.context_parallel_size}: the planner does "
            "not model context parallelism"
        )
        return plan
    shards: dict[int, dict[int, list]] = {}
    experts: dict[int, dict[int, dict[int, list]]] = {}  # [pp][ep][etp] at edp rank 0
    for rank in range(world_size) if all_ranks else _replica(parallel, world_size):
        with simulated_rank(parallel, world_size, rank) as context:
            _check_coordinates(parallel, world_size, rank, context)
            chunks = build_meta_shard(model, parallel, context)
            plan.simulated_ranks.append(rank)
            plan.placements[rank] = chunk_placements(chunks)
            plan.parameters_per_rank[rank] = sum(p.numel() for c in chunks for p in c.parameters())
            if context.dp_rank == 0:
                shards.setdefault(context.pp_rank, {})[context.tp_rank] = chunks
            if context.edp_rank == 0:
                stage = experts.setdefault(context.pp_rank, {})
                stage.setdefault(context.ep_rank, {})[context.etp_rank] = chunks
            if model.is_moe:
                counted = expert_parameter_count(chunks)
                plan.expert_parameters_per_rank[rank] = counted
                if counted != expert_parameters(model, parallel, context.pp_rank):
                    raise RuntimeError(
                        f"rank {rank}'s shard holds {counted} expert parameters, the planner "
                        f"counts {expert_parameters(model, parallel, context.pp_rank)}"
                    )
    plan.model_parameters = sum(
        _numel(shape) for shape in name_map_for(model.model_type).hf_shapes(model).values()
    )
    plan.shard_parameters = distinct_parameters(shards, experts if model.is_moe else {})
    if plan.shard_parameters != plan.model_parameters:
        plan.problems.append(
            f"parameters: the shards hold {plan.shard_parameters} distinct parameters, the "
            f"model has {plan.model_parameters}"
        )
    plan.export = check_export(
        shards,
        model,
        config.rollout.weight_bucket_mib * 2**20,
        experts if model.is_moe else None,
    )
    if not plan.export.complete:
        plan.problems.append(
            f"export: missing {plan.export.missing[:5]}, duplicated {plan.export.duplicated[:5]}, "
            f"wrong shapes {plan.export.wrong_shape[:5]}"
        )
    _plan_memory(plan, config, model, (shards, experts), dp, prompt_tokens, attention, expert_load)
    return plan


def _replica(parallel, world_size: int) -> list[int]:
    """The ranks that hold every distinct shard: data-parallel rank 0 of each stage's
    tensor-parallel ranks, and expert data-parallel rank 0 of its expert ranks."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    etp, ep = parallel.expert_tensor_parallel_size, parallel.expert_model_parallel_size
    dense = {megatron_rank(parallel, world_size, t, 0, p) for t in range(tp) for p in range(pp)}
    sparse = {
        expert_rank(parallel, world_size, t, e, 0, p)
        for t in range(etp)
        for e in range(ep)
        for p in range(pp)
    }
    return sorted(dense | sparse)


def _check_coordinates(parallel, world_size: int, rank: int, context) -> None:
    """The rank arithmetic of this module relies on Megatron's orders; check them on every
    simulated rank."""
    dense = megatron_rank(parallel, world_size, context.tp_rank, context.dp_rank, context.pp_rank)
    sparse = (context.etp_rank, context.ep_rank, context.edp_rank)
    if dense != rank or expert_coordinates(parallel, world_size, rank) != sparse:
        raise RuntimeError(
            f"Megatron placed rank {rank} at tp/dp/pp {context.tp_rank}/{context.dp_rank}/"
            f"{context.pp_rank} and etp/ep/edp {sparse}: the planner's rank order disagrees"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _plan_memory(plan, config, model, shards, dp, prompt_tokens, attention, expert_load) -> None:
    parallel, rollout = config.parallel, config.rollout
    dense_shards, expert_shards = shards
    world, edp = plan.world_size, plan.expert_data_parallel_size
    distributed = config.optimizer.use_distributed_optimizer
    sequences = rollout.prompts_per_step * rollout.samples_per_prompt
    per_rank = -(-sequences // (dp * config.algorithm.optimizer_steps_per_rollout))
    shape = training_shape(config.actor, prompt_tokens + rollout.max_new_tokens, per_rank)
    shape = dataclasses.replace(shape, attention=attention)
    layers = model.num_layers // parallel.pipeline_model_parallel_size
    colocated = rollout.engine in COLOCATED
    firsts = [megatron_rank(parallel, world, 0, d, 0) for d in range(dp)]
    engine_tp = rollout.engine_tensor_parallel_size
    hosts = engine_ranks(firsts, engine_tp) if colocated else set()
    if colocated and len(hosts) < len(firsts) * rollout.engine_tensor_parallel_size:
        plan.problems.append(
            f"rollout.engine_tensor_parallel_size={rollout.engine_tensor_parallel_size}: each "
            "replica's engine spans that many GPUs from its first rank, and the replicas' first "
            f"ranks {firsts[:4]} lie closer than that, so engines would share GPUs"
        )
    spill = [
        f for f in firsts if colocated and f % plan.gpus_per_node + engine_tp > plan.gpus_per_node
    ]
    if spill:
        plan.problems.append(
            f"rollout.engine_tensor_parallel_size={engine_tp}: the engine of the replica whose "
            f"first rank is {spill[0]} would span GPUs past its node's {plan.gpus_per_node} "
            "(an engine's workers run on the GPUs of its first rank's node)"
        )
    short: dict[str, list[int]] = {}  # engine problem -> the ranks that have it
    for rank in range(world):
        tp_rank = rank % parallel.tensor_model_parallel_size
        rest = rank // (parallel.tensor_model_parallel_size * parallel.context_parallel_size)
        dp_rank, pp_rank = rest % dp, rest // dp
        etp_rank, ep_rank, edp_rank = expert_coordinates(parallel, world, rank)
        # The dense part at this rank's data-parallel coordinates, the experts at its expert
        # data-parallel ones (DDP's and the distributed optimizer's two groups of buffers).
        dense = actor_state_bytes(dense_shards[pp_rank][tp_rank], dp, dp_rank, distributed, "dense")
        sparse = actor_state_bytes(
            expert_shards[pp_rank][ep_rank][etp_rank], edp, edp_rank, distributed, "experts"
        )
        # Megatron builds one optimizer per part, and each offloads the fraction of its own.
        dense = offload_optimizer(dense, config.optimizer.cpu_offload_fraction)
        sparse = offload_optimizer(sparse, config.optimizer.cpu_offload_fraction)
        state = dense + sparse
        activations = stage_bytes(
            model,
            parallel,
            shape,
            pp_rank,
            layers,
            expert_load,
            recompute=config.actor.recompute_activations,
        )
        dispatcher = (
            dispatcher_bytes(
                moe_tokens(parallel, shape),
                model,
                parallel,
                DTYPE_BYTES[model.params_dtype],
                expert_load,
            )
            if stage_moe_layers(model, parallel, pp_rank)
            else 0
        )
        memory = RankMemory(
            rank=rank,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            dp_rank=dp_rank,
            ep_rank=ep_rank,
            etp_rank=etp_rank,
            edp_rank=edp_rank,
            weights=state.weights,
            gradients=state.gradients,
            optimizer=state.optimizer,
            optimizer_replicated=state.optimizer_replicated,
            optimizer_distributed=state.optimizer_distributed,
            expert_weights=sparse.weights,
            expert_gradients=sparse.gradients,
            expert_optimizer=sparse.optimizer,
            optimizer_host=state.optimizer_host,
            activations=activations,
            dispatcher=dispatcher,
        )
        training = activations + dispatcher  # what the training pass adds to the state
        kl = config.algorithm.kl
        reference = state.weights if kl is not None and kl.has_reference else 0
        resident = 0  # the reference's weights held on the GPU throughout
        if reference and kl.offload:  # on the GPU only while no training pass is
            training = max(training, reference)
            memory = dataclasses.replace(memory, reference_host=reference)
        elif reference:
            resident = reference
            memory = dataclasses.replace(memory, reference_weights=reference)
        total = state.total + resident + training
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
                total = state.total + resident + max(training, engine_part)
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
        plan.problems.append(_too_big(worst, plan.gpu_bytes))


def _too_big(worst: RankMemory, gpu_bytes: int) -> str:
    """The memory problem of the fullest rank, with its parts."""

    def gb(value: int) -> str:
        return f"{value / GB:.2f}"

    parts = [
        f"weights {gb(worst.weights)}",
        f"gradients {gb(worst.gradients)}",
        f"optimizer {gb(worst.optimizer)}",
        f"activations {gb(worst.activations)}",
    ]
    if worst.dispatcher:
        parts.append(f"dispatcher {gb(worst.dispatcher)}")
    if worst.reference_weights:
        parts.append(f"reference {gb(worst.reference_weights)}")
    counted = worst.weights + worst.gradients + worst.optimizer
    if worst.engine_budget:
        engine_bytes = worst.total - counted - worst.activations - worst.dispatcher
        engine_bytes -= worst.reference_weights
        parts.append(f"engine {gb(engine_bytes)}")
    experts = ""
    if worst.expert_weights:
        experts = (
            f"; of which experts: weights {gb(worst.expert_weights)} + gradients "
            f"{gb(worst.expert_gradients)} + optimizer {gb(worst.expert_optimizer)} GB"
        )
    if worst.optimizer_host:
        experts += f"; besides, {gb(worst.optimizer_host)} GB of optimizer state on the host"
    return (
        f"memory: rank {worst.rank} (pipeline stage {worst.pp_rank}, TP rank {worst.tp_rank}"
        + (f", EP rank {worst.ep_rank}" if worst.expert_weights else "")
        + f") needs {gb(worst.total)} GB > {gb(gpu_bytes)} GB per GPU: "
        + " + ".join(parts)
        + " GB"
        + experts
    )
