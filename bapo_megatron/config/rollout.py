"""Generation (the ``rollout`` section) and the engine kinds that do it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bapo_megatron.config.ranges import require_at_least

EngineKind = Literal["embedded", "vllm", "vllm-server", "sglang", "sglang-server"]
ENGINE_KINDS: tuple[str, ...] = ("embedded", "vllm", "vllm-server", "sglang", "sglang-server")
Placement = Literal["colocated", "disaggregated"]
PLACEMENTS: tuple[str, ...] = ("colocated", "disaggregated")
WeightTransport = Literal["process-group", "same-host", "shard-to-shard"]
WEIGHT_TRANSPORTS: tuple[str, ...] = ("process-group", "same-host", "shard-to-shard")
SHARD_TO_SHARD_ENGINES: tuple[str, ...] = ("embedded", "vllm", "vllm-server")
"""Engines that receive shard to shard (SGLang keeps the broadcast)."""
InflightUpdate = Literal["continue", "resume"]
INFLIGHT_UPDATES: tuple[str, ...] = ("continue", "resume")
Quantization = Literal["fp8"]
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
QUANTIZED_ENGINES: tuple[str, ...] = ("vllm", "sglang")


@dataclass(kw_only=True)
class RolloutConfig:
    """How responses are generated. Temperature is ``actor.temperature`` (the actor's log-probs
    must be those of the distribution the engine sampled from)."""

    engine: EngineKind = "embedded"
    """`embedded`: transformers on the trainer's processes (CPU, the default); `vllm` / `sglang`:
    the engine in-process on the first rank of each model replica, colocated with the actor;
    `vllm-server` / `sglang-server`: a separately started server at ``server_urls``."""
    prompts_per_step: int = 16
    """Prompts drawn per rollout step, over all data-parallel ranks (must divide evenly)."""
    samples_per_prompt: int = 8
    """Responses per prompt (the GRPO group size n; training needs at least 2)."""
    max_new_tokens: int = 256
    """Response length cap; a response cut there ends with finish reason `length`."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 keeps the full distribution (the actor's ratio is then
    exact)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    partial_tokens_per_round: int | None = None
    """Partial rollout: each rollout step generates at most this many tokens per response;
    unfinished responses are paused, carried to the next step and continued under the weights
    of that step (their tokens keep the version they were sampled with). None: off."""
    server_urls: tuple[str, ...] = ()
    """Base URLs of the rollout servers (`vllm-server`, `sglang-server`), one per data-parallel
    rank, or one shared by all."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key of the rollout servers (started
    with ``--api-key``), sent as ``Authorization: Bearer``. The key itself is never in the config
    and is never logged, recorded in metrics or checkpointed. None: no key is sent."""
    weight_transport: WeightTransport = "process-group"
    """How the trainer's weights reach a server engine (`vllm-server`, `sglang-server`).
    `process-group`: the server's workers join a process group with the trainer rank that holds
    its client and every update is broadcast to them (gloo for CPU tensors, NCCL for CUDA ones;
    SGLang's `/init_weights_update_group` and `/update_weights_from_distributed`, vLLM through
    this project's worker extension); the server needs only to reach the trainer's host.
    `same-host`: the vLLM server reloads a safetensors folder its client writes under
    ``train.output_dir`` (same host or a shared filesystem), the SGLang server takes CUDA IPC
    handles (same host). `shard-to-shard` (engines `embedded`, `vllm`, `vllm-server`; colocated
    or disaggregated): each engine worker receives only its own shard, straight from the trainer
    ranks that hold it, with no tensor gathered whole on a trainer rank
    (docs/weight-resharding.md); vLLM's workers, in process or a server's, and engine ranks of
    their own join a process group with every trainer rank. Otherwise in-process engines take the
    tensors directly and disaggregated engine ranks over their own process group, so only
    `process-group` applies to them."""
    engine_tensor_parallel_size: int = 1
    """Tensor parallelism inside an in-process vLLM/SGLang engine (GPUs it spans)."""
    engine_eager: bool = False
    """Run an in-process vLLM engine eagerly (vLLM's ``enforce_eager``: no ``torch.compile``, no
    CUDA graphs): it starts tens of seconds sooner and generates more slowly. For short runs,
    tests and debugging."""
    gpu_memory_utilization: float = 0.5
    """Memory share of an in-process engine, passed on as each engine defines it: vLLM's
    ``gpu_memory_utilization`` (its own budget, which must fit in what the actor leaves free) or
    SGLang's ``mem_fraction_static`` (a share of the whole GPU, the actor's memory included), so
    the same number means more KV cache under SGLang."""
    quantization: Quantization | None = None
    """Quantization of an in-process vLLM/SGLang engine (`vllm`, `sglang`), passed as their
    ``quantization`` argument: `fp8` (the engine quantizes the bf16 weights it loads, at start
    and at every weight update, to FP8 with per-tensor scales, and runs FP8 GEMMs); None: the
    engine computes in the model's dtype. Needs a CUDA GPU with FP8 (compute capability >= 8.9;
    vLLM's CPU build has no FP8), and leaves the actor in its own dtype: the behaviour
    log-probs then differ from the actor's by the quantization error (``logprob_diff/*``),
    which ``algorithm.off_policy_correction`` can weight. A server engine's quantization is set
    where the server starts (``--quantization fp8``)."""
    release_memory_during_training: bool = False
    """Have the engine free its weights and KV cache while the actor trains and reload them for
    the weight sync (colocated GPU runs; a logged no-op where the engine cannot)."""
    weight_bucket_mib: int = 512
    """Size bound of a bucket of the live weight export to the engine."""
    placement: Placement = "colocated"
    """`colocated`: each model replica's engine runs on its first rank, between training phases
    (the synchronous loop); `disaggregated`: the last ``engine_ranks`` ranks of the torchrun
    world run one in-process engine replica each and nothing else, the first ranks train, and
    requests and weights travel over process groups between the two (docs/async-design.md); with
    server engines (`vllm-server`, `sglang-server`) the servers are the engines and have no
    rank (``engine_ranks`` 0), which lets them generate while the trainer learns
    (``algorithm.max_staleness``)."""
    engine_ranks: int = 0
    """Ranks of the torchrun world that run an engine replica (disaggregated placement with an
    in-process engine: at least 1, one per data-parallel replica of the trainer; colocated, or
    server engines: 0)."""
    timeout_s: float | None = None
    """Seconds one generation call may take: past it the engine is aborted and the run stops
    with an error naming the engine (None: no limit). Server clients also give up on a request
    that gets no answer for this long (one hour when None)."""

    sync_interval: int = 1
    """Asynchronous training (``algorithm.max_staleness`` >= 1): push the weights to the engines
    once at least this many policy versions are new since the last push (checked after each
    rollout step's training); at most ``algorithm.max_staleness + 1``."""
    inflight_update: InflightUpdate = "continue"
    """What a weight update does to generation in flight (asynchronous training): `continue`
    loads the new weights between two tokens and goes on (each token keeps the version and
    behaviour log-prob it was sampled with; the KV cache of earlier tokens stays); `resume`
    stops the samples, loads the weights and resumes them from their prefix (its cache
    recomputed under the new weights). `continue` needs an engine that can load weights between
    two tokens (`embedded`)."""

    def __post_init__(self) -> None:
        prefix = "rollout"
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(
                f"{prefix}.timeout_s must be a positive number of seconds or null, "
                f"got {self.timeout_s!r}"
            )
        if self.engine not in ENGINE_KINDS:
            raise ValueError(
                f"{prefix}.engine must be one of {list(ENGINE_KINDS)}, got {self.engine!r}"
            )
        for name in (
            "prompts_per_step",
            "samples_per_prompt",
            "max_new_tokens",
            "engine_tensor_parallel_size",
            "weight_bucket_mib",
        ):
            require_at_least(getattr(self, name), 1, f"{prefix}.{name}")
        require_at_least(self.top_k, 0, f"{prefix}.top_k")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}.top_p must lie in (0, 1], got {self.top_p!r}")
        if self.partial_tokens_per_round is not None:
            require_at_least(self.partial_tokens_per_round, 1, f"{prefix}.partial_tokens_per_round")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"{prefix}.gpu_memory_utilization must lie in (0, 1], "
                f"got {self.gpu_memory_utilization!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"{prefix}.placement must be one of {list(PLACEMENTS)}, got {self.placement!r}"
            )
        require_at_least(self.engine_ranks, 0, f"{prefix}.engine_ranks")
        require_at_least(self.sync_interval, 1, f"{prefix}.sync_interval")
        if self.inflight_update not in INFLIGHT_UPDATES:
            raise ValueError(
                f"{prefix}.inflight_update must be one of {list(INFLIGHT_UPDATES)}, "
                f"got {self.inflight_update!r}"
            )
        servers = self.engine.endswith("-server")
        if self.placement == "disaggregated" and not servers and self.engine_ranks < 1:
            raise ValueError(
                f"{prefix}.placement=disaggregated needs {prefix}.engine_ranks >= 1 (the ranks "
                f"that run an engine replica), got {self.engine_ranks}"
            )
        if self.placement == "disaggregated" and servers and self.engine_ranks:
            raise ValueError(
                f"{prefix}.engine={self.engine!r}: the engines are the servers at "
                f"{prefix}.server_urls, which have no rank in the torchrun world (set "
                f"{prefix}.engine_ranks=0, got {self.engine_ranks})"
            )
        if self.placement == "colocated" and self.engine_ranks:
            raise ValueError(
                f"{prefix}.engine_ranks={self.engine_ranks} applies to "
                f"{prefix}.placement=disaggregated; colocated engines run on the trainer's ranks "
                f"(set {prefix}.engine_ranks=0)"
            )
        if self.api_key_env is not None and not self.api_key_env.strip():
            raise ValueError(
                f"{prefix}.api_key_env must name an environment variable, got an empty string"
            )
        if self.engine.endswith("-server") and not self.server_urls:
            raise ValueError(f"{prefix}.engine={self.engine!r} needs {prefix}.server_urls")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(
                    f"{prefix}.quantization must be one of {list(QUANTIZATIONS)} or null, "
                    f"got {self.quantization!r}"
                )
            if self.engine not in QUANTIZED_ENGINES:
                where = (
                    "start the server with --quantization instead"
                    if self.engine.endswith("-server")
                    else "the embedded engine computes in the model's dtype"
                )
                raise ValueError(
                    f"{prefix}.quantization={self.quantization!r} applies to the in-process "
                    f"engines {list(QUANTIZED_ENGINES)}; {prefix}.engine={self.engine!r}: {where} "
                    f"(set {prefix}.quantization=null)"
                )
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"{prefix}.weight_transport must be one of {list(WEIGHT_TRANSPORTS)}, "
                f"got {self.weight_transport!r}"
            )
        if self.weight_transport == "shard-to-shard" and self.engine not in SHARD_TO_SHARD_ENGINES:
            raise ValueError(
                f"{prefix}.weight_transport=shard-to-shard applies to the engines "
                f"{list(SHARD_TO_SHARD_ENGINES)}; {prefix}.engine={self.engine!r} takes whole "
                f"tensors (set {prefix}.weight_transport=process-group)"
            )
        if self.weight_transport == "same-host" and not self.engine.endswith("-server"):
            raise ValueError(
                f"{prefix}.weight_transport=same-host applies to server engines (vllm-server, "
                f"sglang-server); {prefix}.engine={self.engine!r} takes the tensors directly "
                f"(set {prefix}.weight_transport=process-group)"
            )
