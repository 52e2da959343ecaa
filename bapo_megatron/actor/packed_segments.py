"""Where the sequences of one packed row lie (:mod:`bapo_megatron.actor.packing` builds the
rows; a packed :class:`~bapo_megatron.actor.batch.PolicyBatch` carries them as ``segments``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(frozen=True)
class PackedSegments:
    """Where the sequences of one packed row lie."""

    cu_seqlens: torch.Tensor
    """int32 [segments + 1]: segment boundaries in the row, from 0 to the row's length."""
    sequences: tuple[int, ...]
    """The row of the unpacked batch each segment holds (-1: a padding segment)."""
    source_index: torch.Tensor
    """int64 [row length]: ``row * s + column`` of the unpacked batch each token came from;
    -1 for padding."""

    @property
    def row_length(self) -> int:
        return int(self.source_index.shape[0])

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    def real_tokens(self) -> torch.Tensor:
        """bool [row length]: the token is a sequence's own (not padding)."""
        return self.source_index >= 0

    def sequence_ids(self) -> torch.Tensor:
        """int64 [1, row length]: the segment each token belongs to (what the `seq-mean-*`
        aggregations average over)."""
        spans = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(len(spans)), spans.long())[None]

    def position_ids(self) -> torch.Tensor:
        """int64 [1, row length]: each token's position inside its segment."""
        starts = torch.repeat_interleave(
            self.cu_seqlens[:-1].long(), (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        )
        return (torch.arange(self.row_length) - starts)[None]

    def packed_seq_params(self, device: torch.device) -> PackedSeqParams:
        """Megatron's description of the row. The padded boundaries are the same as the real
        ones: a segment's padding is part of it (after its tokens), which both the local spec's
        attention and Transformer Engine's `padding_causal` THD attention accept."""
        cu = self.cu_seqlens.to(device=device, dtype=torch.int32)
        longest = self.max_seqlen
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
