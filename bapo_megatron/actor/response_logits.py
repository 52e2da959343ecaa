"""Logits only where the loss reads them: the output layer of the last pipeline stage runs on
the hidden states of the positions that predict a response token, not on every position.

A prompt position's logits are never read (its next token is not a response token), yet over a
large vocabulary they cost a GEMM of ``hidden x V`` per position and several ``[positions, V]``
float copies in the log-softmax, forward and backward. Megatron-Core's inference path makes the
same cut for the last token (``materialize_only_last_token_logits``): the hidden states are
indexed before ``output_layer``. Here a forward pre-hook on the output layer, installed for the
duration of one micro-batch's forward, keeps the rows of the sequence-first ``[s, b, h]`` hidden
states at :func:`predicting_rows`. The cut is skipped (every position computed) where the hidden
states a rank holds are not the whole sequence: sequence parallelism (the output layer gathers
them itself), context parallelism, multi-token prediction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageLogits:
    """The last stage's vocabulary-parallel logits of one micro-batch."""

    values: torch.Tensor
    """``[b, s, V/TP]`` at every position (``rows`` None), or ``[1, k, V/TP]`` at ``rows``."""
    rows: torch.Tensor | None
    """The ``k`` positions ``values`` holds, as flat indices ``t * b + i`` into the sequence-first
    ``[s, b]`` grid (position t of row i); None: every position."""


def predicting_rows(response_mask: torch.Tensor) -> torch.Tensor:
    """Flat sequence-first indices ``t * b + i`` of the positions t whose next token ``t + 1`` is
    a response token of row i (``response_mask`` ``[b, s]``), in increasing order."""
    predicts = torch.zeros_like(response_mask)
    predicts[:, :-1] = response_mask[:, 1:]
    return predicts.t().reshape(-1).nonzero().squeeze(1)


def can_select_rows(chunk: torch.nn.Module) -> bool:
    """Whether ``chunk`` (a ``GPTModel``, maybe wrapped) computes logits whose positions can be
    chosen before its output layer: it is a last stage holding whole sequences."""
    model = _gpt_model(chunk)
    if not getattr(model, "post_process", False):
        return False
    config = model.config
    return (
        not model.output_layer.sequence_parallel
        and config.context_parallel_size == 1
        and config.mtp_num_layers is None
    )


@contextlib.contextmanager
def output_rows(chunk: torch.nn.Module, rows: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``chunk``'s output layer computes the logits of ``rows`` only (its
    input ``[s, b, h]`` becomes ``[k, 1, h]``); ``rows`` None: no change."""
    if rows is None:
        yield
        return

    def keep_rows(_module, args, kwargs):
        hidden, *rest = args
        s, b, h = hidden.shape
        return (hidden.reshape(s * b, h).index_select(0, rows).unsqueeze(1), *rest), kwargs

    handle = _gpt_model(chunk).output_layer.register_forward_pre_hook(keep_rows, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Token-aligned ``[b, s]`` of per-position ``values`` ``[k]`` computed at ``rows``: the value
    at position t of row i lands in column t + 1 (the token it predicts); every other column
    holds 0. Differentiable with respect to ``values``."""
    b, s = shape
    flat = values.new_zeros(s * b).index_copy(0, rows + b, values)
    return flat.view(s, b).t()


def _gpt_model(chunk: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(chunk, "output_layer") and hasattr(chunk, "module"):
        chunk = chunk.module  # DDP and other wrappers
    return chunk
