"""The actor's sections: its optimizer and schedule (``optimizer``) and how it runs its passes
(``actor``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from bapo_megatron.config.ranges import require_at_least

LrDecayStyle = Literal["constant", "linear", "cosine"]


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam with decoupled weight decay, a warmup/decay learning-rate schedule and gradient
    clipping: Megatron's optimizer and ``OptimizerParamScheduler``, configured from here."""

    lr: float = 1e-6
    """Peak learning rate (reached after warmup)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (`linear`, `cosine`)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    lr_decay_steps: int | None = None
    """Optimizer steps from the start to the end of the decay; None: no decay (``lr`` after
    warmup, whatever ``lr_decay_style`` says)."""
    lr_decay_style: LrDecayStyle = "constant"
    """`constant`, `linear` or `cosine` decay from ``lr`` to ``min_lr``."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; Megatron exempts biases and norm weights."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still
    computed, logged, and checked for inf/nan)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer).
    Its trainer checkpoints are saved in Megatron's ``dp_reshardable`` format (also on the CPU,
    see :mod:`bapo_megatron.trainer.checkpoint`)."""
    cpu_offload_fraction: float = 0.0
    """Share of this rank's optimizer state whose Adam moments and update move to host memory
    (Megatron's optimizer CPU offload, whole tensors in order until the share is reached); 0:
    off. Needs ``use_distributed_optimizer`` and a CUDA run (Megatron's offloading optimizer is
    CUDA-only). The fp32 main weights stay on the GPU as well: the GPU saves the two fp32
    moments of each offloaded element (8 bytes), the host holds 16 (moments, main weight and
    gradient copies, pinned)."""
    overlap_cpu_offload: bool = True
    """With ``cpu_offload_fraction`` > 0: copy gradients to the host and updated weights back on
    CUDA streams of their own, one host optimizer per tensor, so the copies overlap the host
    update."""

    def __post_init__(self) -> None:
        prefix = "optimizer"
        for name in ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{prefix}.{name} must be a finite number >= 0, got {value!r}")
        if self.min_lr > self.lr:
            raise ValueError(
                f"{prefix}.min_lr ({self.min_lr}) must not exceed {prefix}.lr ({self.lr})"
            )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{prefix}.{name} must lie in [0, 1), got {value!r}")
        require_at_least(self.lr_warmup_steps, 0, f"{prefix}.lr_warmup_steps")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"{prefix}.lr_decay_steps must be an integer > lr_warmup_steps "
                f"({self.lr_warmup_steps}) or null, got {self.lr_decay_steps!r}"
            )
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"{prefix}.lr_decay_style must be 'constant', 'linear' or 'cosine', "
                f"got {self.lr_decay_style!r}"
            )
        fraction = self.cpu_offload_fraction
        if not 0.0 <= fraction <= 1.0:  # also refuses nan
            raise ValueError(f"{prefix}.cpu_offload_fraction must lie in [0, 1], got {fraction!r}")
        if fraction > 0 and not self.use_distributed_optimizer:
            # Megatron offloads the distributed optimizer's fp32 shards; its replicated optimizer
            # would swap in fp32 copies after the offloading optimizer was built around others.
            raise ValueError(
                f"{prefix}.cpu_offload_fraction={fraction} needs "
                f"{prefix}.use_distributed_optimizer: true"
            )


@dataclass(kw_only=True)
class ActorConfig:
    """How the actor runs its passes over a batch."""

    micro_batch_size: int = 1
    """Sequences per micro-batch (one forward/backward of the pipeline schedule); not used where
    a token budget (``max_tokens_per_microbatch``) fills the micro-batches instead."""
    pack_sequences: bool = False
    """Run each micro-batch as one packed row of concatenated sequences (Megatron's THD format
    with ``PackedSeqParams``) instead of rows right-padded to the longest sequence: each sequence
    is padded only to the layout's length multiple, rotary positions restart at every sequence
    and attention never crosses a boundary. Same results as padded rows (to float rounding),
    without computing the padding. Off by default for the CPU configs this project ships: there
    attention runs one fused call per packed sequence, which costs a tiny model more than
    padding short sequences does (the tiny CPU run: 67 s packed, 57 s padded); every GPU recipe
    turns it on with a token budget."""
    max_tokens_per_microbatch: int | None = None
    """With ``pack_sequences``: fill micro-batches by tokens instead of by count, up to this many
    tokens each (first-fit decreasing over the sequences as packed); a sequence longer than the
    budget gets a micro-batch of its own, never truncated (counted in the metric
    `actor/over_budget_sequences`). Training steps also balance the step's sequences over the
    data-parallel ranks by their compute before splitting. None: ``micro_batch_size`` sequences
    per micro-batch."""
    logprob_max_tokens_per_microbatch: int | None = None
    """Token budget of the forward-only passes (old log-probs, routes, evaluation), which keep no
    activations for a backward pass and can take larger micro-batches; None: the training
    budget ``max_tokens_per_microbatch``."""
    temperature: float = 1.0
    """Sampling temperature of the rollout: the actor's log-probs and entropy are those of
    softmax(logits / temperature), the distribution the engine sampled from."""
    seed: int = 1234
    """Seed of the initial weights (when not loaded from a checkpoint)."""
    recompute_activations: bool = False
    """Keep only each layer's input during the training forward pass and recompute the layer in
    the backward pass (Megatron's full recompute): less activation memory for one more forward.
    Under routing replay the recomputed routers replay the same routes."""

    def __post_init__(self) -> None:
        prefix = "actor"
        if self.micro_batch_size < 1:
            raise ValueError(
                f"{prefix}.micro_batch_size must be a positive integer, "
                f"got {self.micro_batch_size!r}"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"{prefix}.temperature must be a finite number > 0, got {self.temperature!r}"
            )
        require_at_least(self.seed, 0, f"{prefix}.seed")
        for name in ("max_tokens_per_microbatch", "logprob_max_tokens_per_microbatch"):
            value = getattr(self, name)
            if value is None:
                continue
            require_at_least(value, 2, f"{prefix}.{name}")
            if not self.pack_sequences:
                raise ValueError(
                    f"{prefix}.{name}={value} fills packed rows by tokens and needs "
                    f"{prefix}.pack_sequences: true"
                )

    def logprob_token_budget(self) -> int | None:
        """The token budget of forward-only passes (see ``logprob_max_tokens_per_microbatch``)."""
        if self.logprob_max_tokens_per_microbatch is not None:
            return self.logprob_max_tokens_per_microbatch
        return self.max_tokens_per_microbatch
