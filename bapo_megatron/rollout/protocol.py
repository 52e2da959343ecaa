"""What every rollout engine offers the trainer, and the records it returns.

Behaviour log-probs: for each sampled token, log softmax(logits / temperature)[token] over the
full vocabulary: after temperature, before any top-k/top-p truncation. That is the distribution
the actor's log-probs are computed from (:mod:`bapo_megatron.actor.logprobs`), so the
importance ratio compares like with like. (With top-k/top-p < 1 the tokens are drawn from the
truncated distribution; the ratio then measures the change of the untruncated policy, as the
actor can only compute that one.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from bapo_megatron.config import ModelConfig

FinishReason = Literal["stop", "length", "abort", "paused"]
"""`stop`: a stop token was sampled (it is kept); `length`: ``max_new_tokens`` or the end of the
model's context reached;
`abort`: cut by :meth:`RolloutEngine.abort` (final); `paused`: cut by a round's token budget or
:meth:`RolloutEngine.pause`, to be continued with :meth:`RolloutEngine.continue_generation`."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample; the same fields every engine maps to its own API."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Softmax temperature > 0 (the actor must use the same; see ``actor.temperature``)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with probability >= top_p; 1 keeps all."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = 256
    """Tokens a sample may generate in total (over all rounds of a partial rollout)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (kept as its last token)."""
    seed: int | None = None
    """Seed of the sampling generator, for reproducible rollouts; None: fresh randomness."""

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"sampling.n must be a positive integer, got {self.n!r}")
        if not (
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature > 0
        ):
            raise ValueError(
                f"sampling.temperature must be a finite number > 0, got {self.temperature!r}"
            )
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"sampling.top_p must lie in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling.top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(
                f"sampling.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(kw_only=True)
class RolloutSample:
    """One sampled continuation of one prompt, token by token."""

    prompt_index: int
    """Position of its prompt in the ``generate`` call."""
    sample_index: int
    """Which of the prompt's ``n`` samples it is."""
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    """Generated tokens so far."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-prob of each generated token (see the module docstring)."""
    versions: list[int] = field(default_factory=list)
    """Policy version of the weights each generated token was sampled with."""
    finish_reason: FinishReason | None = None
    """None while generating; see :data:`FinishReason`."""
    routes: list[list[list[int]]] | None = None
    """Mixture-of-experts models, engines that record them: the expert ids each token (prompt
    tokens, then generated ones) was routed to, per MoE layer, as the engine ran it; one entry
    per token except the last sampled one, which the engine never ran. None otherwise."""

    @property
    def resumable(self) -> bool:
        """Paused, not finished: :meth:`RolloutEngine.continue_generation` takes it."""
        return self.finish_reason == "paused"


class RolloutEngine(Protocol):
    """The engine protocol the trainer drives. Calls that an engine cannot honour on a given
    machine are logged no-ops (say so in the engine's docstring), never silent successes."""

    version: int
    """Policy version of the loaded weights (-1 before any update)."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, round_tokens: int | None = None
    ) -> list[RolloutSample]:
        """``params.n`` samples per prompt, prompt-major. ``round_tokens`` caps the tokens each
        sample generates in this call; samples cut by it come back `paused`."""

    def continue_generation(
        self,
        samples: list[RolloutSample],
        params: SamplingParams,
        *,
        round_tokens: int | None = None,
    ) -> list[RolloutSample]:
        """Continue `paused` samples under the current weights, extending their token, log-prob
        and version lists (earlier tokens keep theirs); others are returned unchanged."""

    def abort(self) -> None:
        """Stop in-flight generation; its unfinished samples come back `abort` with what they
        have so far. Callable from another thread."""

    def pause(self) -> None:
        """Stop in-flight generation before its next token (samples come back `paused`) and
        refuse to start new tokens until :meth:`resume`."""

    def resume(self) -> None:
        """Undo :meth:`pause`."""

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        checksum: bool = False,
    ) -> str | None:
        """Load HF-named tensors (all of the model's, or a subset) and set :attr:`version`;
        with ``checksum``, return a SHA-256 over the names and bytes loaded."""

    def release_memory(self) -> None:
        """Free weights and caches for a colocated training phase (weights must be updated
        again after :meth:`resume_memory`)."""

    def resume_memory(self) -> None:
        """Re-allocate what :meth:`release_memory` freed."""

    def health(self) -> bool:
        """Whether the engine can serve requests now."""


def check_ready(released: bool, version: int) -> None:
    """Refuse generation from an engine whose memory is released or that holds no weights yet."""
    if released:
        raise RuntimeError(
            "generate after release_memory(): call resume_memory() and update_weights() first"
        )
    if version < 0:
        raise RuntimeError(
            "generate before a complete update_weights(): the engine holds no whole policy "
            "weights (none loaded yet, or the last update failed part-way)"
        )


def check_prompts(prompts: list[list[int]], model: ModelConfig) -> None:
    """Refuse empty prompts, token ids outside the vocabulary and prompts that fill the model's
    context (``max_position_embeddings``), leaving no position to generate into."""
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{index}] is empty; a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(
                f"prompts[{index}] holds token ids outside the vocabulary "
                f"[0, {model.vocab_size}): {bad[:5]}"
            )
        if len(prompt) >= model.max_position_embeddings:
            raise ValueError(
                f"prompts[{index}] has {len(prompt)} tokens; the model's context "
                f"(max_position_embeddings) is {model.max_position_embeddings}, "
                "which leaves no room for a response"
            )
