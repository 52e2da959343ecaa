r"""Per-token log-probs and entropy from tensor-parallel vocabulary shards, without gathering V.

Each tensor-parallel rank holds the logits of a contiguous slice of the vocabulary, columns
[vocab_start, vocab_start + V_local) (shards may be uneven). With z = logits / T (temperature T):

    m      = max_v z_v                        all-reduce MAX of the per-row local max (detached)
    S      = sum_v exp(z_v - m)               \
    M      = sum_v exp(z_v - m) (z_v - m)      > one all-reduce SUM of the stacked per-row sums
    z_y    = z at the target y                /  (the rank owning y contributes it, others 0)
    log p(y) = z_y - m - log S
    H        = -sum_v p_v log p_v = log S - M / S            (= log Z - E_p[z], m cancels)

Gradients with respect to the local shard (no collective: m, S and M are already global):

    d log p(y) / d logits_v = (1[v = y] - p_v) / T
    d H        / d logits_v = -p_v (z_v - E_p[z]) / T

Temperature convention: the result is the log-prob of the temperature-scaled distribution
softmax(logits / T) over the full vocabulary, which is what the rollout engines report when they
return processed log-probs (vLLM ``logprobs_mode="processed_logprobs"``, SGLang by default), so
importance ratios against rollout log-probs compare like with like. Top-k / top-p truncation is
not applied. Megatron pads the vocabulary (to a multiple of 128 x TP) while the engines drop the
padded columns; pass the true ``vocab_size`` so those columns leave the distribution.

Numerics are float32 at least (bf16 / fp16 logits are upcast; float64 stays float64). Backward
keeps the input logits (no copy) and three numbers per row, and recomputes the softmax of the
local shard. Both passes walk the rows in chunks of a few MB: the only full-size tensor either
allocates is the gradient it returns.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["token_logprobs_and_entropy"]


# Rows go through the vocabulary in chunks of about this many elements (4 MB in float32). A
# chunk's temporaries stay in cache and come back from the heap on the next chunk, where
# full-size [rows, vocabulary] temporaries (hundreds of MB at a 49k vocabulary) are fresh pages
# every call: on a CPU, faulting them in cost more than the arithmetic. Much smaller chunks pay
# Python's per-chunk overhead instead (docs/benchmarks.md).
_CHUNK_ELEMENTS = 1 << 20


def _world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _scaled(logits: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """z = logits / T in ``dtype``, always a fresh tensor (callers work on it in place)."""
    z = logits.to(dtype, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _chunks(rows: int, width: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _owned_targets(
    targets: torch.Tensor, vocab_start: int, valid: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows' targets this shard holds, and their columns (clamped into the shard)."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < valid)
    return owned, local.clamp(0, max(valid - 1, 0))


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Forward: both outputs with two collectives (MAX, then one stacked SUM). Backward: local."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        temperature: float,
        vocab_size: int | None,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, ...]:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        width = logits.shape[-1]
        # Megatron's padding columns are the shard's tail: they are left out of every sum.
        valid = width if vocab_size is None else max(0, min(width, vocab_size - vocab_start))
        rows = targets.numel()  # not reshape(-1, width): a shard may hold no column
        flat = logits.reshape(rows, width)
        owned, index = _owned_targets(targets.reshape(-1), vocab_start, valid)

        # Global row max for stability. It only shifts the exponent, so it carries no gradient;
        # max(x) / T is max(x / T) exactly (rounding is monotone).
        if valid > 0:
            m = flat[:, :valid].amax(dim=-1).to(dtype)
            m = m / temperature if temperature != 1.0 else m
        else:
            m = torch.full((rows,), -math.inf, dtype=dtype, device=logits.device)
        if distributed := _world_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)

        # Per row: sum exp(z - m), z_y - m (0 where the target is elsewhere), the ownership
        # count and sum exp(z - m) (z - m), one all-reduce for all of them.
        stats = torch.zeros(4 if with_entropy else 3, rows, dtype=dtype, device=logits.device)
        stats[2] = owned.to(dtype)
        for part in _chunks(rows, valid) if valid > 0 else []:
            z = _scaled(flat[part, :valid], temperature, dtype).sub_(m[part, None])
            z_y = z.gather(-1, index[part, None]).squeeze(-1)
            stats[1, part] = torch.where(owned[part], z_y, 0.0)
            e = z.exp()
            stats[0, part] = e.sum(-1)
            if with_entropy:
                stats[3, part] = e.mul_(z).sum(-1)
        if distributed:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

        # Each target must lie in exactly one shard. After the reduce every rank sees the same
        # counts, so every rank raises together (nobody is left waiting in a collective).
        if not bool((stats[2] == 1).all()):
            bound = vocab_size if vocab_size is not None else "the sum of the shard widths"
            raise ValueError(
                f"targets: every target must index the vocabulary [0, {bound}) and lie in exactly "
                "one shard; found targets outside it (or shards that overlap or leave gaps)"
            )

        log_s = stats[0].log()
        log_z = m + log_s  # log of the full partition function of z
        outputs = [(stats[1] - log_s).view(targets.shape)]
        mean_z = log_z  # placeholder when the entropy is not asked for (unused in backward)
        if with_entropy:
            mu = stats[3] / stats[0]  # E_p[z] - m
            outputs.append((log_s - mu).view(targets.shape))
            mean_z = m + mu
        ctx.save_for_backward(logits, targets, log_z, mean_z)
        ctx.vocab_start, ctx.temperature, ctx.dtype = vocab_start, temperature, dtype
        ctx.valid, ctx.with_entropy = valid, with_entropy
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        logits, targets, log_z, mean_z = ctx.saved_tensors
        g_logp = grads[0]
        g_ent = grads[1] if ctx.with_entropy else None
        if g_logp is None and g_ent is None:
            return (None,) * 7
        dtype, valid, width = ctx.dtype, ctx.valid, logits.shape[-1]
        rows = targets.numel()
        flat = logits.reshape(rows, width)
        g_logp = None if g_logp is None else g_logp.reshape(-1).to(dtype)
        g_ent = None if g_ent is None else g_ent.reshape(-1).to(dtype)
        owned, index = _owned_targets(targets.reshape(-1), ctx.vocab_start, valid)
        grad = torch.empty(rows, width, dtype=logits.dtype, device=logits.device)
        grad[:, valid:] = 0.0  # padding columns
        # dL/dz_v = g_logp (1[v=y] - p_v) - g_ent p_v (z_v - E_p[z])
        #         = -p_v (g_logp + g_ent (z_v - E_p[z])) + g_logp 1[v=y]
        for part in _chunks(rows, valid) if valid > 0 else []:
            z = _scaled(flat[part, :valid], ctx.temperature, dtype)
            p = (z - log_z[part, None]).exp_()  # this chunk of the shard's global softmax
            if g_ent is not None:
                coeff = z.sub_(mean_z[part, None]).mul_(g_ent[part, None])
                if g_logp is not None:
                    coeff.add_(g_logp[part, None])
            else:
                coeff = g_logp[part, None]
            chunk = p.mul_(coeff).neg_()
            if g_logp is not None:  # + g_logp 1[v = y]
                hit = torch.where(owned[part], g_logp[part], 0.0)
                chunk.scatter_add_(-1, index[part, None], hit[:, None])
            if ctx.temperature != 1.0:
                chunk.div_(ctx.temperature)
            grad[part, :valid] = chunk
        return grad.view(logits.shape), None, None, None, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target token and the full-vocabulary entropy, from this rank's shard.

    Args:
        logits: ``[..., V_local]``, this tensor-parallel rank's columns
            [vocab_start, vocab_start + V_local) of the full (possibly padded) vocabulary.
        targets: ``[...]`` integer token ids in the full vocabulary, same on every rank.
        vocab_start: first global column of this shard (shards may be uneven).
        group: the tensor-parallel group; None or a group of one means one process holding the
            whole vocabulary (no collectives).
        temperature: T > 0; the distribution is softmax(logits / T) (see the module docstring).
        vocab_size: the true vocabulary size when the shards include padding columns: columns at
            or past it get probability 0 and zero gradient. None: every column counts.
        with_entropy: compute the entropy too (one more per-row sum in the same all-reduce).

    Returns:
        ``(logprobs, entropy)``, each ``[...]`` in float32 (float64 for float64 logits); entropy
        is None without ``with_entropy``. Both are differentiable with respect to ``logits``.

    Two collectives per call (MAX, then SUM), none in backward, one host sync (the target check).
    Every rank of ``group`` must call it with the same targets and leading shape.
    """
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point tensor, got {logits.dtype}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected an integer tensor, got {targets.dtype}")
    if logits.dim() < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} must be logits' shape without "
            f"its last (vocabulary) dim, {tuple(logits.shape[:-1])}"
        )
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start: must be >= 0, got {vocab_start}")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size: must be > 0, got {vocab_size}")
    outputs = _VocabParallelLogProbEntropy.apply(
        logits,
        targets.long(),
        int(vocab_start),
        group,
        float(temperature),
        vocab_size,
        with_entropy,
    )
    return outputs[0], (outputs[1] if with_entropy else None)
