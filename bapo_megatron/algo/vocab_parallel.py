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
local shard: no full-vocabulary probability tensor outlives the forward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["token_logprobs_and_entropy"]


def _world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _scaled(
    logits: torch.Tensor, temperature: float, dtype: torch.dtype, pad: torch.Tensor | None
) -> torch.Tensor:
    """z = logits / T in ``dtype``, padded columns at -inf (they get probability exactly 0)."""
    z = logits.to(dtype)
    z = z / temperature if temperature != 1.0 else z.clone()
    return z if pad is None else z.masked_fill_(pad, -math.inf)


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
        distributed = _world_size(group) > 1
        pad = None
        if vocab_size is not None and vocab_start + width > vocab_size:
            pad = torch.arange(vocab_start, vocab_start + width, device=logits.device) >= vocab_size
        z = _scaled(logits, temperature, dtype, pad)

        # Global row max for stability. It only shifts the exponent, so it carries no gradient.
        if width > 0:
            m = z.amax(dim=-1)
        else:
            m = torch.full(z.shape[:-1], -math.inf, dtype=dtype, device=z.device)
        if distributed:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)

        z.sub_(m.unsqueeze(-1))  # z - m in place; with e the forward holds two float copies
        e = z.exp()  # exactly 0 at padded columns
        local = targets - vocab_start
        owned = (local >= 0) & (local < width)
        if vocab_size is not None:
            owned &= targets < vocab_size  # a padded column is no token
        index = local.clamp(0, max(width - 1, 0)).unsqueeze(-1)
        z_y = z.gather(-1, index).squeeze(-1) if width > 0 else torch.zeros_like(m)
        rows = [e.sum(-1), torch.where(owned, z_y, 0.0), owned.to(dtype)]  # z_y is z_y - m
        if with_entropy:
            # exp(z - m) (z - m), with 0 (not 0 * -inf) at padded columns.
            ez = e.mul_(z) if pad is None else e.mul_(z.masked_fill_(pad, 0.0))
            rows.append(ez.sum(-1))
        del z, e
        stats = torch.stack(rows)
        if distributed:  # sum-exp, target logit, ownership count and sum p*logit in one go
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
        logprobs = stats[1] - log_s
        outputs = [logprobs]
        mean_z = log_z  # placeholder when the entropy is not asked for (unused in backward)
        if with_entropy:
            mu = stats[3] / stats[0]  # E_p[z] - m
            outputs.append(log_s - mu)
            mean_z = m + mu
        ctx.save_for_backward(logits, targets, log_z, mean_z)
        ctx.vocab_start, ctx.temperature, ctx.dtype = vocab_start, temperature, dtype
        ctx.pad, ctx.with_entropy = pad, with_entropy
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
        z = _scaled(logits, ctx.temperature, ctx.dtype, ctx.pad)
        p = (z - log_z.unsqueeze(-1)).exp_()  # the local shard of the global softmax
        # dL/dz_v = g_logp (1[v=y] - p_v) - g_ent p_v (z_v - E_p[z])
        #         = -p_v (g_logp + g_ent (z_v - E_p[z])) + g_logp 1[v=y]
        if g_ent is not None:
            coeff = z.sub_(mean_z.unsqueeze(-1))
            if ctx.pad is not None:
                coeff.masked_fill_(ctx.pad, 0.0)  # -inf there, and p = 0
            coeff.mul_(g_ent.to(ctx.dtype).unsqueeze(-1))
            if g_logp is not None:
                coeff.add_(g_logp.to(ctx.dtype).unsqueeze(-1))
        else:
            coeff = g_logp.to(ctx.dtype).unsqueeze(-1)
        grad = p.mul_(coeff).neg_()
        if g_logp is not None and grad.shape[-1] > 0:
            local = targets - ctx.vocab_start
            owned = (local >= 0) & (local < grad.shape[-1])
            index = local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1)
            hit = torch.where(owned, g_logp.to(ctx.dtype), 0.0)  # + g_logp 1[v = y]
            grad.scatter_add_(-1, index, hit.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(logits.dtype), None, None, None, None, None, None


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
