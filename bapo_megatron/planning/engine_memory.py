"""Memory of a rollout engine colocated with the actor (``rollout.engine`` `vllm` or `sglang`):
its bf16 weights and KV cache on each GPU it spans, and which GPUs those are.

An in-process engine runs on the first rank of each data-parallel replica and spans
``engine_tensor_parallel_size`` GPUs from there (that rank's node's GPUs, i.e. the next global
ranks). Its budget is ``gpu_memory_utilization`` of the GPU, read as each engine defines it:
vLLM's ``gpu_memory_utilization`` is the engine's own share (weights, KV cache and its working
memory), on top of what the actor holds; SGLang's ``mem_fraction_static`` is the share of the
whole GPU that static memory may reach, the actor's state included, the engine's KV pool taking
what is left of it. The engines' own working memory (CUDA graphs, sampler buffers) is not
modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_megatron.config import ModelConfig, RolloutConfig

ENGINE_BYTES = 2  # engines serve bf16 weights and a bf16 KV cache
COLOCATED = ("vllm", "sglang")


@dataclass(frozen=True)
class EngineMemory:
    """One engine GPU's share of a colocated engine."""

    budget: int
    """Bytes the engine may use on this GPU (vLLM) or static bytes the GPU may hold (SGLang)."""
    weights: int
    """Engine weight bytes on this GPU."""
    kv_cache: int
    """KV cache bytes left in the budget (negative: the budget does not hold the weights)."""
    kv_bytes_per_token: int
    """KV cache bytes one token takes on this GPU."""
    context_tokens: int
    """Tokens the engine must hold for one full-length sequence (vLLM refuses to start
    otherwise)."""

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return max(0, self.kv_cache) // self.kv_bytes_per_token


def engine_memory(
    model: ModelConfig,
    rollout: RolloutConfig,
    parameters: int,
    gpu_bytes: int,
    actor_static: int,
    context_tokens: int,
) -> EngineMemory:
    """The engine's memory on one of its GPUs: ``parameters`` (the whole model's) split over
    ``engine_tensor_parallel_size``, beside ``actor_static`` bytes of actor state (counted
    against SGLang's fraction only)."""
    tp = rollout.engine_tensor_parallel_size
    weights = -(-parameters * ENGINE_BYTES // tp)
    kv_heads = max(1, model.num_query_groups // tp)  # engines replicate KV heads past their count
    kv_per_token = 2 * model.num_layers * kv_heads * model.head_dim * ENGINE_BYTES
    budget = int(rollout.gpu_memory_utilization * gpu_bytes)
    if rollout.engine == "sglang":
        kv_cache = budget - actor_static - weights
    elif rollout.engine == "vllm":
        kv_cache = budget - weights
    else:
        raise ValueError(f"rollout.engine={rollout.engine!r} is not colocated")
    return EngineMemory(
        budget=budget,
        weights=weights,
        kv_cache=kv_cache,
        kv_bytes_per_token=kv_per_token,
        context_tokens=context_tokens,
    )


def engine_ranks(first_ranks: list[int], engine_tp: int) -> set[int]:
    """Global ranks whose GPU an engine uses: ``engine_tp`` GPUs from each replica's first
    rank."""
    return {first + offset for first in first_ranks for offset in range(engine_tp)}
