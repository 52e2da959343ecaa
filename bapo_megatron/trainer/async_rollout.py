"""Phases 1 and 6 of asynchronous training (``algorithm.max_staleness`` >= 1): rollout items
admitted to the engine ranks ahead of time (:mod:`bapo_megatron.trainer.admission`), the step's
item taken when it is ready, and weights pushed without waiting for the engines to load them.
The other phases are the synchronous loop's (:mod:`bapo_megatron.trainer.loop`)."""

from __future__ import annotations

import dataclasses
import time

from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.distributed.collectives import sum_over
from bapo_megatron.trainer.admission import admission_limit
from bapo_megatron.trainer.phases import Rollout, encoded_prompts, replica_rows, seed
from bapo_megatron.trainer.setup import Run, push_policy, watched


@watched("1. rollout (asynchronous)")
def take_rollout(run: Run, step: int) -> Rollout | None:
    """1. Rollout: admit every item the engines may start now, then wait for this step's item
    (replicas' first ranks; every rank advances the data position and the admission count)."""
    _admit(run, step)
    rollout = None
    client = run.engines.stream if run.engines is not None else None
    if client is not None:
        queued = client.in_flight
        with run.timer.phase("rollout"):
            waited = time.perf_counter()
            samples, stats = client.take(step)
            wait_s = time.perf_counter() - waited
        n = run.sampling.n
        rows = _item_rows(run, step, step)
        finished = [(row, samples[i * n : (i + 1) * n]) for i, row in enumerate(rows)]
        generated = sum(len(s.token_ids) for s in samples)
        rollout = Rollout(finished, generated, engine=stats, wait_s=wait_s, queued=queued)
    run.state.position += run.cfg.rollout.prompts_per_step
    return rollout


def _admit(run: Run, step: int) -> None:
    cfg, progress = run.cfg, run.stream
    limit = admission_limit(
        step=step,
        version=run.state.version,
        pushed_version=progress.pushed_version,
        max_staleness=cfg.algorithm.max_staleness,
        versions_per_step=cfg.algorithm.optimizer_steps_per_rollout,
        last_step=cfg.train.steps - 1,
    )
    client = run.engines.stream if run.engines is not None else None
    while progress.next_item <= limit:
        item = progress.next_item
        if client is not None:
            prompts = encoded_prompts(run, _item_rows(run, step, item))
            item_seed = seed(cfg.train.seed, item, run.context.dp_rank)
            client.submit(item, prompts, dataclasses.replace(run.sampling, seed=item_seed))
        progress.next_item += 1


def _item_rows(run: Run, step: int, item: int) -> list[PromptRow]:
    """This replica's prompt rows of item ``item`` seen from rollout step ``step``: the data
    position advances by ``prompts_per_step`` per step, as in the synchronous loop, so the
    items are the synchronous steps' prompts."""
    return replica_rows(run, run.state.position + (item - step) * run.cfg.rollout.prompts_per_step)


@watched("6. weight sync (asynchronous)")
def send_weights(run: Run) -> None:
    """6. Push the policy once ``rollout.sync_interval`` versions are new since the last push;
    the engines load it between two tokens or items while the trainer goes on."""
    progress = run.stream
    if run.state.version - progress.pushed_version >= run.cfg.rollout.sync_interval:
        with run.timer.phase("weight_sync"):
            push_policy(run, run.state.version)
        progress.pushed_version = run.state.version


def weight_update_metrics(run: Run) -> dict[str, float]:
    """The weights sent to the engines during the step (bytes, over every export rank) and how
    far the engines' newest version is behind the policy (collective over the trainer world)."""
    progress = run.stream
    sent = run.engines.sent_bytes if run.engines is not None else 0
    sent += run.weights.sent_bytes
    (total,) = sum_over([float(sent - progress.sent_bytes)], None, run.context.device)
    progress.sent_bytes = sent
    return {
        "async/weight_update_bytes": total,
        "async/pushed_version": float(progress.pushed_version),
        "async/engine_versions_behind": float(run.state.version - progress.pushed_version),
    }
