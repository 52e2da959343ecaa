"""How the actor is split over ranks (the ``parallel`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fp8Format = Literal["e4m3", "hybrid"]
Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8", "blockwise"]
Fp8AmaxAlgo = Literal["most_recent", "max"]
DeviceChoice = Literal["auto", "cpu", "cuda"]
TokenDispatcher = Literal["alltoall", "allgather"]


@dataclass(kw_only=True)
class ParallelConfig:
    """How the actor is split over ranks, and its FP8 mode. Data parallel is what is left: world
    size / (tensor x pipeline x context). Which combinations a given model and world size accept
    is checked by :func:`bapo_megatron.distributed.layout.validate_layout`. The fp8 fields are
    passed through unchanged to Megatron's ``TransformerConfig`` (they need Transformer Engine
    and an FP8-capable GPU)."""

    device: DeviceChoice = "auto"
    """Where the actor (and a colocated embedded engine) computes: `cuda` (NCCL, one GPU per
    rank, the GPU of ``LOCAL_RANK``), `cpu` (gloo and the CPU runtime patches of
    ``bapo_megatron/megatron_patches/README.md``), or `auto`: CUDA when torch sees a GPU, else
    the CPU, unless the environment variable ``BAPO_DEVICE`` names one (test suites set it to run
    on the CPU of a GPU machine)."""
    deterministic: bool = False
    """Use only deterministic kernels (``torch.use_deterministic_algorithms``, and the fixed
    cuBLAS workspace it needs): on a GPU, two runs with the same seeds, and a run resumed from a
    checkpoint, then compute bitwise the same. Slower; the CPU is deterministic without it."""
    tensor_model_parallel_size: int = 1
    """Ranks each layer's matrices are split over (heads, MLP columns, vocabulary)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; each holds a contiguous block of layers."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage for the interleaved schedule; None: not interleaved."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over (needs Transformer Engine's attention)."""
    sequence_parallel: bool = False
    """Shard norm and dropout activations over the tensor-parallel ranks along the sequence
    (Megatron's sequence parallelism; needs tensor_model_parallel_size > 1, and is required
    with it for a mixture-of-experts model)."""
    expert_model_parallel_size: int = 1
    """Ranks the experts of each MoE layer are divided over (each holds num_experts / this
    many). Megatron carves it out of the data-parallel x tensor-parallel ranks of a pipeline
    stage: expert_tensor_parallel_size x this must divide tensor x context x data parallel."""
    expert_tensor_parallel_size: int = 1
    """Ranks each expert's matrices are split over (Megatron's expert tensor parallelism); 1
    keeps every expert whole on its rank, the usual choice (Megatron's own default is the
    tensor-parallel size)."""
    moe_token_dispatcher: TokenDispatcher = "alltoall"
    """How tokens reach the experts of other expert-parallel ranks: `alltoall` (each rank sends
    exactly the tokens routed to the others' experts) or `allgather` (every rank gathers every
    token). Only used by mixture-of-experts models."""
    fp8: Fp8Format | None = None
    """FP8 format for Transformer Engine GEMMs: `e4m3`, or `hybrid` (e4m3 forward, e5m2
    gradients); None: no FP8. Passed through to Megatron (``TransformerConfig.fp8``). Needs
    Transformer Engine's layers on a CUDA GPU with FP8 (compute capability >= 8.9: Ada, Hopper,
    Blackwell): refused with ``device: cpu`` here, and without TE or such a GPU by
    :func:`~bapo_megatron.distributed.layout.validate_layout`. Every micro-batch's tokens must
    then be a multiple of :func:`fp8_length_multiple`."""
    fp8_recipe: Fp8Recipe = "delayed"
    """Transformer Engine scaling recipe (Megatron's names, ``TransformerConfig.fp8_recipe``):
    `delayed` (per-tensor scales from an amax history), `tensorwise` (per-tensor scales of the
    current tensor), `blockwise` (1x128 / 128x128 blocks; Hopper and newer) or `mxfp8`
    (Blackwell only). Read only when ``fp8`` is set."""
    fp8_amax_history_len: int = 1
    """Window of amax values kept for the delayed-scaling factor. Passed through to Megatron."""
    fp8_amax_compute_algo: Fp8AmaxAlgo = "most_recent"
    """Amax from the window used for scaling: `most_recent` or `max`. Passed through to
    Megatron."""
    collective_timeout_s: float = 900.0
    """How long a rank waits in a collective for the others before the run stops with an error
    (torch's own default is 30 minutes); long enough for an engine's start-up or a checkpoint
    write that the other ranks wait for."""
    stall_report_s: float = 300.0
    """A phase of a rollout step that lasts this long logs which rank has not reached it (read
    from the process group's store), well before ``collective_timeout_s`` stops the run."""
    startup_timeout_s: float = 300.0
    """How long a rank started by torchrun waits for the rendezvous store and for every other
    rank of its attempt to arrive before the run stops with an error naming the store's address
    and the ranks that did not come (a peer that never started, a stale address after a
    restart). Far shorter than ``collective_timeout_s``: the ranks of one attempt start together,
    so it only has to cover their imports' spread."""

    def __post_init__(self) -> None:
        prefix = "parallel"
        for name in ("collective_timeout_s", "stall_report_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{prefix}.{name} must be a number > 0, got {getattr(self, name)!r}"
                )
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "fp8_amax_history_len",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{prefix}.{name} must be a positive integer, got {value!r}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if vpp < 2:
                raise ValueError(
                    f"{prefix}.virtual_pipeline_model_parallel_size must be an integer >= 2 "
                    f"or null, got {vpp!r}"
                )
            if self.pipeline_model_parallel_size < 2:
                raise ValueError(
                    f"{prefix}.virtual_pipeline_model_parallel_size={vpp} needs "
                    f"{prefix}.pipeline_model_parallel_size > 1, "
                    f"got {self.pipeline_model_parallel_size}"
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                f"{prefix}.sequence_parallel=true needs {prefix}.tensor_model_parallel_size > 1 "
                "(it shards activations over the tensor-parallel ranks)"
            )
        if self.moe_token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(
                f"{prefix}.moe_token_dispatcher must be 'alltoall' or 'allgather', "
                f"got {self.moe_token_dispatcher!r}"
            )
        if self.fp8 not in (None, "e4m3", "hybrid"):
            raise ValueError(f"{prefix}.fp8 must be 'e4m3', 'hybrid' or null, got {self.fp8!r}")
        if self.fp8_recipe not in ("delayed", "tensorwise", "mxfp8", "blockwise"):
            raise ValueError(
                f"{prefix}.fp8_recipe must be one of "
                "['delayed', 'tensorwise', 'mxfp8', 'blockwise'], "
                f"got {self.fp8_recipe!r}"
            )
        if self.fp8 is not None and self.device == "cpu":
            raise ValueError(
                f"{prefix}.fp8={self.fp8!r} runs in Transformer Engine's layers on a CUDA GPU, "
                f"but {prefix}.device is 'cpu' (set {prefix}.fp8=null)"
            )
        if self.fp8_amax_compute_algo not in ("most_recent", "max"):
            raise ValueError(
                f"{prefix}.fp8_amax_compute_algo must be 'most_recent' or 'max', "
                f"got {self.fp8_amax_compute_algo!r}"
            )

    @property
    def expert_parallel_size(self) -> int:
        """Ranks of one pipeline stage that together hold every expert once: expert tensor x
        expert model parallel."""
        return self.expert_tensor_parallel_size * self.expert_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: tensor x pipeline x context."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )


FP8_LENGTH_MULTIPLES: dict[str, int] = {
    "delayed": 16,
    "tensorwise": 16,
    "mxfp8": 32,
    "blockwise": 128,
}
"""What the tokens of one micro-batch must be a multiple of, per FP8 recipe (see
:func:`fp8_length_multiple`)."""


def fp8_length_multiple(parallel: ParallelConfig) -> int:
    """What the number of tokens of each micro-batch (the GEMMs' token dimension, sequences x
    padded length when packed) must be a multiple of under ``parallel``'s FP8 mode; 1 without
    FP8. For the packing code, which pads to it.

    - `delayed`, `tensorwise`: 16. cuBLASLt's FP8 GEMMs need every dimension a multiple of 16
      (Transformer Engine asserts it before each FP8 GEMM, and Megatron's
      ``get_fp8_align_size`` pads MoE tokens per expert to 16).
    - `mxfp8`: 32, the MX block (32 elements share one scale; Megatron aligns to 32).
    - `blockwise`: 128. The weight-gradient GEMM contracts over the tokens, whose activations
      and output gradients are quantized in 1x128 blocks along that dimension; Megatron's
      helper says 16 for it (for the per-expert split), so 128 is the safe choice until the
      GPU check measures the smaller one.

    Under sequence parallelism each tensor-parallel rank holds 1/TP of the tokens, so a row's
    length is padded to this times the TP size there
    (:func:`bapo_megatron.actor.microbatches.length_multiples`)."""
    if parallel.fp8 is None:
        return 1
    return FP8_LENGTH_MULTIPLES[parallel.fp8_recipe]
