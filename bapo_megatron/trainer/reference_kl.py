"""The reference policy's part of phase 4 (old log-probs): its log-probs of every mini-batch,
kept in the batch for a KL term in the loss, or turned into a reward penalty from which the
groups' advantages are computed again (``algorithm.kl.placement``). Runs on every rank of each
replica, after the old log-probs are final (recomputed or the engine's)."""

from __future__ import annotations

import dataclasses

import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.algo.advantages import grpo_advantages
from bapo_megatron.algo.kl import kl_penalized_rewards, sequence_kl
from bapo_megatron.config.run import AlgorithmConfig
from bapo_megatron.data.experience import Group
from bapo_megatron.distributed.collectives import sum_over
from bapo_megatron.trainer.setup import Run

Minibatch = tuple[PolicyBatch, torch.Tensor]
"""A policy batch and the policy version of each of its response tokens, as in phase 4."""


def with_reference(
    run: Run, minibatches: list[Minibatch], parts: list[list[Group]]
) -> tuple[list[Minibatch], dict[str, float]]:
    """``minibatches`` (whose groups are ``parts``) with the reference's log-probs, or under
    placement `reward` with the penalised advantages instead; and the step's ``kl/*`` rollout
    metrics: `kl/rollout_mean` (the estimator between the old and the reference log-probs, mean
    over the step's response tokens) and, under `reward`, `kl/reward_penalty` (mean over samples
    of what their rewards lost)."""
    cfg, context = run.cfg, run.context
    kl = cfg.algorithm.kl
    out = []
    total = tokens = penalty = samples = 0.0
    with run.timer.phase("reference_logprobs"):
        for (batch, versions), groups in zip(minibatches, parts, strict=True):
            ref = run.reference.logprobs(
                batch,
                batching=Batching.for_logprobs(cfg.actor),
                temperature=cfg.actor.temperature,
                fp8_multiple=run.actor.fp8_length_multiple,
            )
            mask = batch.response_mask
            per_sequence = sequence_kl(batch.old_logprobs, ref, mask, kl.estimator)
            total += float(per_sequence.sum())
            tokens += float(mask.sum())
            if kl.placement == "reward":
                advantages, lost = _penalised_advantages(
                    groups, per_sequence, kl.coef, cfg.algorithm
                )
                penalty += lost
                samples += float(batch.num_sequences)
                batch = dataclasses.replace(batch, advantages=advantages)
            else:
                batch = dataclasses.replace(batch, ref_logprobs=torch.where(mask, ref, 0.0))
            out.append((batch, versions))
    total, tokens, penalty, samples = sum_over(
        [total, tokens, penalty, samples], context.dp_group, context.device
    )
    metrics = {"kl/rollout_mean": total / max(tokens, 1.0)}
    if kl.placement == "reward":
        metrics["kl/reward_penalty"] = penalty / max(samples, 1.0)
    return out, metrics


def _penalised_advantages(
    groups: list[Group], per_sequence: torch.Tensor, coef: float, algo: AlgorithmConfig
) -> tuple[torch.Tensor, float]:
    """Per-row advantages of the batch of ``groups`` (rows group by group, as
    :func:`~bapo_megatron.data.experience.to_policy_batch` lays them out) from the rewards less
    ``coef`` times each row's summed KL; and the penalty summed over the rows."""
    advantages, start = [], 0
    for group in groups:
        n = len(group.samples)
        rewards = torch.tensor(group.rewards, dtype=torch.float64)[None]
        kls = per_sequence[start : start + n][None]
        scores = kl_penalized_rewards(rewards, kls, coef)
        advantages.append(
            grpo_advantages(
                scores, normalize_std=algo.normalize_std, one_sample=algo.one_sample_advantage
            )[0]
        )
        start += n
    if start != per_sequence.numel():
        raise AssertionError("the batch's rows are not its groups' samples")
    joined = torch.cat(advantages) if advantages else torch.zeros(0, dtype=torch.float64)
    return joined.float(), coef * float(per_sequence.sum())
