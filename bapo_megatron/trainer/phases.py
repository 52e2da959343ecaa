"""The phases of a rollout step that produce the training batches (see
:mod:`bapo_megatron.trainer.loop`): generation, scoring and off-policy selection on each
replica's engine rank (None on the other ranks), then the old log-probs on every rank.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs, compute_logprobs_and_routes
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.algo.advantages import grpo_advantages, informative_groups
from bapo_megatron.algo.importance_weights import importance_weights
from bapo_megatron.algo.overlong import OverlongShaping, shape_overlong
from bapo_megatron.data.experience import Group, prompts_at, split_groups, to_policy_batch
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.data.task import encode_prompt
from bapo_megatron.disaggregated.stream_server import ItemStats
from bapo_megatron.distributed.collectives import sum_over
from bapo_megatron.trainer.admission import mixed_version_samples, stale_groups
from bapo_megatron.trainer.metrics import LogprobGap, RolloutCounts, rollout_metrics
from bapo_megatron.trainer.reference_kl import with_reference
from bapo_megatron.trainer.replicas import share_from_engine_rank
from bapo_megatron.trainer.router_metrics import RouterAgreement
from bapo_megatron.trainer.setup import Run, watched
from bapo_megatron.trainer.state import PausedGroup

Minibatch = tuple[PolicyBatch, torch.Tensor]
"""A policy batch and the policy version of each of its response tokens (-1 elsewhere)."""


@dataclass
class Rollout:
    """What the engine generated in one rollout step."""

    finished: list[PausedGroup]
    """Groups all of whose samples have finished (started now or continued from the paused ones)."""
    generated_tokens: int
    engine: ItemStats | None = None
    """Asynchronous training: the engine's account of the step's rollout item."""
    wait_s: float = 0.0
    """Asynchronous training: seconds the trainer waited for the item."""
    queued: int = 0
    """Asynchronous training: items admitted and not yet trained when the step began."""


@dataclass
class Experience:
    """Scored groups of one replica, and the rollout statistics they came with."""

    groups: list[Group]
    counts: RolloutCounts


def seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of ``parts``."""
    return random.Random("/".join(map(str, parts))).getrandbits(63)


@watched("1. rollout")
def generate(run: Run, step: int) -> Rollout | None:
    """1. Rollout: this replica's prompts of the step (with partial rollout, the groups paused
    last step first). Every rank advances the data position."""
    state, cfg, context = run.state, run.cfg, run.context
    rollout = None
    if run.engine is not None:
        with run.timer.phase("rollout"):
            finished, state.paused_groups, generated = _generate(
                run,
                replica_rows(run, state.position),
                seed=seed(cfg.train.seed, step, context.dp_rank),
            )
        rollout = Rollout(finished, generated)
    state.position += cfg.rollout.prompts_per_step
    return rollout


def replica_rows(run: Run, position: int) -> list[PromptRow]:
    """This replica's prompt rows of the rollout step whose prompts start at data position
    ``position`` (over all replicas)."""
    cfg = run.cfg
    indices = prompts_at(
        position + run.context.dp_rank * run.per_replica,
        run.per_replica,
        len(run.task.rows),
        cfg.train.seed,
        cfg.data.shuffle,
    )
    return [run.task.rows[i] for i in indices]


def encoded_prompts(run: Run, rows: list[PromptRow]) -> list[list[int]]:
    """The token ids of ``rows``' prompts, as the engines take them."""
    max_new_tokens = run.sampling.max_new_tokens
    return [
        encode_prompt(run.task, row, run.cfg.data.system_prompt, max_new_tokens) for row in rows
    ]


def _generate(run: Run, rows, *, seed: int) -> tuple[list[PausedGroup], list[PausedGroup], int]:
    """Start ``rows``, continue the groups paused by the previous round, and return
    (finished groups, still-paused groups, tokens generated). A group finishes when all its
    samples have."""
    engine, sampling, unfinished = run.engine, run.sampling, run.state.paused_groups
    budget = run.cfg.rollout.partial_tokens_per_round
    before = sum(len(s.token_ids) for _, samples in unfinished for s in samples)
    if unfinished:
        paused = [s for _, samples in unfinished for s in samples]
        engine.continue_generation(
            paused, dataclasses.replace(sampling, seed=seed + 1), round_tokens=budget
        )
    samples = engine.generate(
        encoded_prompts(run, rows), dataclasses.replace(sampling, seed=seed), round_tokens=budget
    )
    n = sampling.n
    groups = list(unfinished) + [(row, samples[i * n : (i + 1) * n]) for i, row in enumerate(rows)]
    finished = [g for g in groups if not any(s.resumable for s in g[1])]
    paused = [g for g in groups if any(s.resumable for s in g[1])]
    generated = sum(len(s.token_ids) for _, samples in groups for s in samples) - before
    return finished, paused, generated


@watched("2. reward")
def score(run: Run, rollout: Rollout | None) -> Experience | None:
    """2. Reward: rewards (with ``loss.overlong``'s penalty), GRPO advantages and rollout
    statistics of the finished groups (groups whose samples all scored the same are dropped
    under ``filter_equal_groups``, responses cut off at the length cap under
    ``loss.overlong.filter``)."""
    if rollout is None:
        return None
    with run.timer.phase("reward"):
        experience = score_groups(run, rollout.finished)
    counts = experience.counts
    counts.generated_tokens = rollout.generated_tokens
    if rollout.engine is not None:
        counts.mixed_version_samples = float(mixed_version_samples(rollout.finished))
        counts.engine_idle_s = rollout.engine.idle_s
        counts.engine_generate_s = rollout.engine.generate_s
        counts.engine_load_s = rollout.engine.load_s
        counts.engine_loads = float(rollout.engine.loads)
        counts.trainer_wait_s = rollout.wait_s
        counts.queued_items = float(rollout.queued)
    return experience


def score_groups(run: Run, finished: list[PausedGroup]) -> Experience:
    """Rewards, advantages and counts of ``finished`` (phase 2's work, also refill rounds')."""
    algo, task = run.cfg.algorithm, run.task
    counts = RolloutCounts()
    if not finished:
        return Experience([], counts)
    flat = [(row, s) for row, samples in finished for s in samples]
    texts = [task.tokenizer.decode(s.token_ids, skip_special_tokens=True) for _, s in flat]
    scored = run.rewards.score(
        texts,
        [row.answer for row, _ in flat],
        data_sources=[row.data_source for row, _ in flat],
        extra_infos=[row.extra_info for row, _ in flat],
    )
    n = len(finished[0][1])
    values = torch.tensor(scored.rewards, dtype=torch.float64).reshape(len(finished), n)
    lengths = torch.tensor([len(s.token_ids) for _, s in flat], dtype=torch.float64)
    overlong = _overlong(run, values, lengths, [s.finish_reason == "length" for _, s in flat])
    shaped = overlong.rewards
    advantages = grpo_advantages(
        shaped, normalize_std=algo.normalize_std, one_sample=algo.one_sample_advantage
    )
    keep = informative_groups(shaped)
    groups = [
        Group(
            prompt_id=row.id,
            samples=samples,
            rewards=shaped[i].tolist(),
            advantages=advantages[i].tolist(),
        ).with_samples(overlong.trained[i].tolist())
        for i, (row, samples) in enumerate(finished)
        if (keep[i] or not algo.filter_equal_groups) and overlong.trained[i].any()
    ]
    right = values.reshape(-1) > 0.5
    counts = RolloutCounts(
        samples=len(flat),
        reward=float(values.sum()),
        correct=float(right.sum()),
        length=float(lengths.sum()),
        length_right=float(lengths[right].sum()),
        right=float(right.sum()),
        length_wrong=float(lengths[~right].sum()),
        wrong=float((~right).sum()),
        truncated=float(sum(s.finish_reason == "length" for _, s in flat)),
        truncated_wrong=float(
            sum(s.finish_reason == "length" and not ok for (_, s), ok in zip(flat, right.tolist()))
        ),
        groups=float(len(finished)),
        informative_groups=float(keep.sum()),
        reward_timeouts=float(scored.timed_out),
        reward_errors=float(len(scored.errors)),
        overlong_penalty=float(overlong.penalty.sum()),
        overlong_penalized=float((overlong.penalty < 0).sum()),
        overlong_filtered=float((~overlong.trained).sum()),
    )
    counts.add_reward_metrics(scored.metrics)
    return Experience(groups, counts)


def _overlong(
    run: Run, rewards: torch.Tensor, lengths: torch.Tensor, truncated: list[bool]
) -> OverlongShaping:
    """``loss.overlong``'s penalty on the [groups, n] ``rewards`` and its filter."""
    overlong = run.cfg.loss.overlong
    return shape_overlong(
        rewards,
        lengths.view_as(rewards),
        torch.tensor(truncated).view_as(rewards),
        max_length=run.cfg.rollout.max_new_tokens,
        buffer_length=overlong.buffer_length,
        penalty_factor=overlong.penalty_factor,
        filter_truncated=overlong.filter,
    )


@watched("3. off-policy selection")
def select_off_policy(run: Run, fresh: Experience | None, step: int) -> Experience | None:
    """3. Off-policy selection: with ``max_staleness``, groups sampled too long ago are
    dropped (counted); with ``rollout_lag``, the groups scored that many steps ago train now;
    with ``replay_fraction``, groups drawn from the replay buffer join them (and the chosen ones
    enter the buffer)."""
    if fresh is None:
        return None
    algo, state = run.cfg.algorithm, run.state
    chosen = fresh.groups
    if algo.max_staleness:
        stale = stale_groups(chosen, version=state.version, max_staleness=algo.max_staleness)
        chosen = [group for group, old in zip(chosen, stale) if not old]
        fresh.counts.dropped_groups = float(sum(stale))
    if algo.rollout_lag:
        state.lag_queue.append(fresh.groups)
        chosen = state.lag_queue.pop(0) if len(state.lag_queue) > algo.rollout_lag else []
    if algo.replay_fraction:
        count = round(len(chosen) * algo.replay_fraction / (1 - algo.replay_fraction))
        draw = random.Random(seed(run.cfg.train.seed, step, run.context.dp_rank))
        replayed = state.replay.sample(count, state.version, draw)
        state.replay.add(chosen)
        chosen = chosen + replayed
    return Experience(chosen, fresh.counts)


@watched("4. old log-probs")
def old_logprobs(
    run: Run, experience: Experience | None, step: int
) -> tuple[list[Minibatch], dict[str, float]]:
    """4. The engine rank's groups on every rank of its replica, as the step's mini-batches,
    with the actor's old log-probs when the ratio is taken against the actor (or, every
    ``logging.logprob_diff_interval`` steps, to measure the engine/actor gap) and the reference
    policy's log-probs under ``algorithm.kl``; and the step's rollout metrics."""
    cfg, context = run.cfg, run.context
    algo = cfg.algorithm
    chosen, counts = share_from_engine_rank(
        None if experience is None else (experience.groups, experience.counts), context
    )
    metrics = rollout_metrics(
        counts,
        context,
        asynchronous=bool(algo.max_staleness),
        overlong=cfg.loss.overlong.enabled,
        refill=algo.max_refill_rounds is not None,
    )
    # a mini-batch without a group on any replica (filtered groups, partial rollouts that
    # did not finish) is skipped; one empty on some replicas only still trains on the others
    parts = split_groups(chosen, algo.optimizer_steps_per_rollout)
    groups_per_part = sum_over(
        [float(len(part)) for part in parts], context.dp_group, context.device
    )
    parts = [part for part, everywhere in zip(parts, groups_per_part) if everywhere]
    minibatches = [to_policy_batch(part, run.task.pad_token_id) for part in parts]
    measure_gap = (
        cfg.logging.logprob_diff_interval and step % cfg.logging.logprob_diff_interval == 0
    )
    if measure_gap and run.actor.routing_replay is not None:
        agreement = RouterAgreement(num_experts=run.actor.model_config.moe.num_experts)
        with run.timer.phase("old_logprobs"):
            for batch, versions in minibatches:
                agreement.add(
                    run.actor,
                    batch,
                    versions == run.state.version,
                    temperature=cfg.actor.temperature,
                )
        metrics.update(agreement.metrics(context))
    minibatches = [_engine_routes_kept(item, algo.routing_replay) for item in minibatches]
    if minibatches and (algo.old_logprobs == "recompute" or measure_gap):
        gap = LogprobGap()
        with run.timer.phase("old_logprobs"):
            minibatches = [
                (recompute(run, batch, versions == run.state.version, gap), versions)
                for batch, versions in minibatches
            ]
        metrics.update(gap.metrics(context))
    if minibatches and run.reference is not None:  # on the final old log-probs
        minibatches, kl_metrics = with_reference(run, minibatches, parts)
        metrics.update(kl_metrics)
    return minibatches, metrics


def _engine_routes_kept(
    batch_and_versions: tuple[PolicyBatch, torch.Tensor], routing_replay: str
) -> tuple[PolicyBatch, torch.Tensor]:
    """The engine's routes stay with the batch (and are replayed) under routing replay
    `rollout` only."""
    batch, versions = batch_and_versions
    if routing_replay != "rollout" and batch.routes is not None:
        batch = dataclasses.replace(batch, routes=None)
    return batch, versions


def recompute(run: Run, batch: PolicyBatch, current: torch.Tensor, gap: LogprobGap) -> PolicyBatch:
    """``batch`` with the actor's log-probs as old log-probs (``recompute``; with an off-policy
    correction, its importance weights, added to ``gap``) or unchanged (``engine``); under
    routing replay `trainer`, with the routes of this pass. The
    actor/engine gap is added to ``gap`` either way, over the tokens sampled with the actor's
    current weights (``current``): on older tokens it would also hold the policy's own drift
    since they were sampled."""
    cfg = run.cfg
    if cfg.algorithm.routing_replay == "trainer" and cfg.algorithm.old_logprobs == "recompute":
        # R2: the routes of this pass are the ones the step's training passes replay
        recomputed, routes = compute_logprobs_and_routes(
            run.actor.chunks,
            batch,
            run.actor.context,
            run.actor.routing_replay,
            batching=Batching.for_logprobs(cfg.actor),
            fp8_multiple=run.actor.fp8_length_multiple,
            temperature=cfg.actor.temperature,
        )
        batch = dataclasses.replace(batch, routes=routes)
    else:  # with routing replay `rollout`, the engine's routes (batch.routes) are replayed
        recomputed, _ = compute_logprobs(
            run.actor.chunks,
            batch,
            run.actor.context,
            batching=Batching.for_logprobs(cfg.actor),
            fp8_multiple=run.actor.fp8_length_multiple,
            temperature=cfg.actor.temperature,
            with_entropy=False,
            routing=run.actor.routing_replay,
        )
    mask = batch.response_mask
    same_policy = mask & current
    gap.add_gap((recomputed - batch.old_logprobs)[same_policy], same_policy)
    if cfg.algorithm.old_logprobs == "engine":
        return batch
    weights = None
    correction = cfg.resolved_off_policy_correction()
    if correction != "none":
        corrected = importance_weights(
            correction,
            recomputed,
            batch.old_logprobs,
            mask,
            cfg.loss.truncated_is_cap,
            cfg.loss.mismatch_band(),
        )
        weights = corrected.weights
        gap.add_weights(correction, corrected.statistics)
    return dataclasses.replace(
        batch, old_logprobs=torch.where(mask, recomputed, 0.0), is_weights=weights
    )
