"""The actor's input: one data-parallel rank's sequences for an optimizer step, and their split
into the equal-shaped micro-batches Megatron's pipeline schedules need (padded rows here; packed
rows, one row of concatenated sequences, in :mod:`bapo_megatron.actor.packing`).

Every per-token tensor is aligned with ``tokens``: column t describes token t (its response mask,
the log-prob it was sampled with, its advantage). The model's output at position t - 1 predicts
token t, so column 0 never counts (it has no predecessor) and must not be a response token.
Sequences are right-padded; padding columns are never response tokens, and causal attention
keeps them from affecting real ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bapo_megatron.actor.packed_segments import PackedSegments


@dataclass(frozen=True)
class PolicyBatch:
    """Sequences of one data-parallel rank, with what the loss needs per response token."""

    tokens: torch.Tensor
    """[n, s] int64 token ids: prompt, response, right padding."""
    response_mask: torch.Tensor
    """[n, s] bool: token t is a response token whose log-prob enters the loss."""
    old_logprobs: torch.Tensor | None = None
    """[n, s] float: log-prob of token t under the policy the ratio is taken against (behaviour
    or recomputed); required for training, not for a forward-only pass."""
    advantages: torch.Tensor | None = None
    """[n] (one value per sequence) or [n, s] float; required for training."""
    is_weights: torch.Tensor | None = None
    """[n, s] float truncated importance weights, or None."""
    ref_logprobs: torch.Tensor | None = None
    """[n, s] float: log-prob of token t under the frozen reference policy, for a KL term in
    the loss (``algorithm.kl``), or None."""
    routes: torch.Tensor | None = None
    """[n, s, moe_layers, topk] integer expert ids each token was routed to (a mixture-of-experts
    model under routing replay; a row of -1: no route, routed live), or None
    (:mod:`bapo_megatron.actor.routing_replay`)."""
    segments: PackedSegments | None = None
    """Set on a packed micro-batch (one row of concatenated sequences): where each sequence
    lies in the row (:mod:`bapo_megatron.actor.packing`); None for rows of one sequence each."""

    def __post_init__(self) -> None:
        tokens, mask = self.tokens, self.response_mask
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(
                f"batch.tokens: expected a [sequences, tokens] tensor, got "
                f"{getattr(tokens, 'shape', type(tokens).__name__)}"
            )
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"batch.tokens: expected integer token ids, got {tokens.dtype}")
        if not isinstance(mask, torch.Tensor) or mask.shape != tokens.shape:
            raise ValueError(
                f"batch.response_mask: expected shape {tuple(tokens.shape)}, got "
                f"{getattr(mask, 'shape', type(mask).__name__)}"
            )
        if mask.dtype != torch.bool:
            raise ValueError(f"batch.response_mask: expected a bool tensor, got {mask.dtype}")
        if tokens.shape[1] < 2 and tokens.shape[0] > 0:
            raise ValueError(
                "batch.tokens: sequences need at least 2 tokens (a prompt token and a "
                f"response token), got length {tokens.shape[1]}"
            )
        if tokens.numel() and bool(mask[:, 0].any()):
            raise ValueError(
                "batch.response_mask: column 0 is marked as a response token, but the "
                "first token has no preceding position to predict it"
            )
        for name in ("old_logprobs", "is_weights", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, torch.Tensor)
                or value.shape != tokens.shape
                or not value.is_floating_point()
            ):
                raise ValueError(
                    f"batch.{name}: expected a float tensor of shape {tuple(tokens.shape)}, "
                    f"got {getattr(value, 'shape', type(value).__name__)}"
                )
        routes = self.routes
        if routes is not None and (
            not isinstance(routes, torch.Tensor)
            or routes.dim() != 4
            or routes.shape[:2] != tokens.shape
        ):
            raise ValueError(
                f"batch.routes: expected a [{tokens.shape[0]}, {tokens.shape[1]}, moe_layers, "
                f"topk] tensor, got {getattr(routes, 'shape', type(routes).__name__)}"
            )
        segments = self.segments
        if segments is not None and (
            tokens.shape[0] != 1 or segments.row_length != tokens.shape[1]
        ):
            raise ValueError(
                f"batch.segments: a packed batch is one row of {segments.row_length} tokens, "
                f"got tokens of shape {tuple(tokens.shape)}"
            )
        adv = self.advantages
        if adv is not None and (
            not isinstance(adv, torch.Tensor)
            or not adv.is_floating_point()
            or adv.shape not in (tokens.shape, tokens.shape[:1])
        ):
            raise ValueError(
                f"batch.advantages: expected a float tensor of shape {tuple(tokens.shape)} "
                f"or {tuple(tokens.shape[:1])}, got {getattr(adv, 'shape', type(adv).__name__)}"
            )

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def require_training_fields(self) -> None:
        """Raise ``ValueError`` unless the fields a training step needs are present."""
        for name in ("old_logprobs", "advantages"):
            if getattr(self, name) is None:
                raise ValueError(f"batch.{name} is required for a training step")

    def select(self, rows: slice) -> PolicyBatch:
        """The sequences ``rows`` (a slice), every field sliced alike."""
        if self.segments is not None:
            raise ValueError("batch.select: a packed row cannot be split by rows")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(
            self,
            **{
                name: value[rows]
                for name, value in values.items()
                if value is not None and name != "segments"
            },
        )


def _padded_routes(routes: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """``routes`` in a [rows, length, ...] tensor of missing routes (-1: routed live)."""
    out = routes.new_full((rows, length, *routes.shape[2:]), -1)
    out[: routes.shape[0], : routes.shape[1]] = routes
    return out


def microbatch_count(num_sequences: int, micro_batch_size: int) -> int:
    """Micro-batches needed for ``num_sequences`` at ``micro_batch_size`` (the last may be
    short)."""
    return math.ceil(num_sequences / micro_batch_size)


def split_microbatches(
    batch: PolicyBatch,
    micro_batch_size: int,
    num_microbatches: int,
    seq_multiple: int = 1,
    length: int | None = None,
) -> list[PolicyBatch]:
    """``num_microbatches`` micro-batches of exactly ``micro_batch_size`` sequences each.

    Sequences are taken in order; the short last micro-batch and any further ones (data-parallel
    ranks must all run the same count) are filled with empty rows: token 0, no response token,
    advantage 0, log-prob 0. The sequence length is padded to a multiple of ``seq_multiple``
    (sequence parallelism splits it over tensor-parallel ranks), or is ``length`` when given (a
    length agreed with other ranks). Megatron's pipeline schedules exchange activations of one
    fixed shape, hence equal shapes throughout.
    """
    if num_microbatches < microbatch_count(batch.num_sequences, micro_batch_size):
        raise ValueError(
            f"{batch.num_sequences} sequences do not fit in {num_microbatches} "
            f"micro-batches of {micro_batch_size}"
        )
    rows = num_microbatches * micro_batch_size
    longest = -(-max(batch.tokens.shape[1], 2) // seq_multiple) * seq_multiple
    if length is not None and length < longest:
        raise ValueError(f"rows of {longest} tokens do not fit in an agreed length of {length}")
    length = longest if length is None else length

    def padded(value: torch.Tensor | None, per_token: bool) -> torch.Tensor | None:
        if value is None:
            return None
        shape = (rows, length) if per_token else (rows,)
        out = value.new_zeros(shape)
        if per_token:
            out[: value.shape[0], : value.shape[1]] = value
        else:
            out[: value.shape[0]] = value
        return out

    adv = batch.advantages
    full = PolicyBatch(
        tokens=padded(batch.tokens.long(), True),
        response_mask=padded(batch.response_mask, True),
        old_logprobs=padded(batch.old_logprobs, True),
        advantages=padded(adv, adv is None or adv.dim() == 2),
        is_weights=padded(batch.is_weights, True),
        ref_logprobs=padded(batch.ref_logprobs, True),
        routes=None if batch.routes is None else _padded_routes(batch.routes, rows, length),
    )
    return [
        full.select(slice(i * micro_batch_size, (i + 1) * micro_batch_size))
        for i in range(num_microbatches)
    ]
