"""Dynamic sampling with refill (``algorithm.max_refill_rounds``, docs/algorithm.md section
6.2): after phase 2 dropped the groups whose rewards are all equal, a replica with fewer groups
than its share of ``rollout.prompts_per_step`` generates and scores another round of prompts,
up to the bound, and keeps its share.

The refill prompts come from a stream of their own over the prompt set (seeded apart from the
main one): replica d's k-th refill round ever takes block ``k * replicas + d`` of it, so the
replicas never share a block and need not agree on how many rounds they take, and the main
stream's positions, which asynchronous training admits items by ahead of time, stay those of a
run without refill. ``TrainerState.refill_rounds`` (k, checkpointed on each replica's engine
rank) makes a resumed run draw what the uninterrupted one would. Asynchronous training sends a
refill round to its engine as an item of its own (a negative id) and waits for it; its tokens
carry the versions they were sampled with, so phase 3's staleness rule applies to them exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from bapo_megatron.data.experience import prompts_at
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.rollout.protocol import RolloutSample
from bapo_megatron.trainer.metrics import RolloutCounts
from bapo_megatron.trainer.phases import Experience, encoded_prompts, score_groups, seed
from bapo_megatron.trainer.setup import Run, watched

log = logging.getLogger("bapo_megatron.train")
REFILL_STREAM = 1
"""Mixed into the refill stream's seed, so its order differs from the main stream's."""


@watched("2. reward (refill)")
def refill(run: Run, experience: Experience | None, step: int) -> Experience | None:
    """``experience`` topped up to this replica's share of groups by refill rounds (engine
    ranks; None elsewhere, and unchanged without ``max_refill_rounds``)."""
    bound = run.cfg.algorithm.max_refill_rounds
    if experience is None or bound is None:
        return experience
    want = run.per_replica
    groups, counts = list(experience.groups), experience.counts
    rounds = 0
    while len(groups) < want and rounds < bound:
        rounds += 1
        rows = refill_rows(run, run.state.refill_rounds)
        run.state.refill_rounds += 1
        sample_seed = seed(run.cfg.train.seed, step, run.context.dp_rank, REFILL_STREAM, rounds)
        samples = _generate_round(run, rows, sample_seed, counts, item=-(1 + step * bound + rounds))
        n = run.sampling.n
        finished = [(row, samples[i * n : (i + 1) * n]) for i, row in enumerate(rows)]
        with run.timer.phase("reward"):
            more = score_groups(run, finished)
        groups += more.groups
        _add_counts(counts, more.counts)
    counts.refill_rounds = float(rounds)
    counts.short_groups = float(max(0, want - len(groups)))
    counts.surplus_groups = float(max(0, len(groups) - want))
    if len(groups) < want:
        log.warning(
            "rollout step %d, replica %d: %d of %d groups carry signal after %d refill rounds "
            "(algorithm.max_refill_rounds); training on those",
            step,
            run.context.dp_rank,
            len(groups),
            want,
            rounds,
        )
    return Experience(groups[:want], counts)


def refill_rows(run: Run, taken: int) -> list[PromptRow]:
    """This replica's prompt rows of its refill round number ``taken`` (counting from 0)."""
    cfg, replicas = run.cfg, run.context.dp_size
    block = taken * replicas + run.context.dp_rank
    indices = prompts_at(
        block * run.per_replica,
        run.per_replica,
        len(run.task.rows),
        seed(cfg.train.seed, REFILL_STREAM),
        cfg.data.shuffle,
    )
    return [run.task.rows[i] for i in indices]


def _generate_round(
    run: Run, rows: list[PromptRow], sample_seed: int, counts: RolloutCounts, *, item: int
) -> list[RolloutSample]:
    """The samples of ``rows`` from this replica's engine (the colocated one, or asynchronous
    training's engine rank as item ``item``), its tokens added to ``counts``."""
    params = dataclasses.replace(run.sampling, seed=sample_seed)
    prompts = encoded_prompts(run, rows)
    client = run.engines.stream if run.engines is not None else None
    with run.timer.phase("rollout"):
        if client is None:
            samples = run.engine.generate(prompts, params)
        else:
            waited = time.perf_counter()
            client.submit(item, prompts, params)
            samples, stats = client.take(item)
            counts.trainer_wait_s += time.perf_counter() - waited
            counts.engine_idle_s += stats.idle_s
            counts.engine_generate_s += stats.generate_s
            counts.engine_load_s += stats.load_s
            counts.engine_loads += float(stats.loads)
    counts.generated_tokens += sum(len(s.token_ids) for s in samples)
    return samples


def _add_counts(counts: RolloutCounts, more: RolloutCounts) -> None:
    """``more``'s sums of the scored samples into ``counts`` (the engine's are added apart)."""
    for name in (
        "samples",
        "reward",
        "correct",
        "length",
        "length_right",
        "right",
        "length_wrong",
        "wrong",
        "truncated",
        "truncated_wrong",
        "groups",
        "informative_groups",
        "reward_timeouts",
        "reward_errors",
    ):
        setattr(counts, name, getattr(counts, name) + getattr(more, name))
    for name, (total, checks) in more.reward_metrics.items():
        before = counts.reward_metrics.get(name, (0.0, 0.0))
        counts.reward_metrics[name] = (before[0] + total, before[1] + checks)
