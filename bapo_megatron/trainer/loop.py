"""The RL training loop, started by :mod:`bapo_megatron.trainer.main`.

One rollout step, top to bottom in :func:`train`:

1. rollout: each model replica's engine (on its first rank) generates its share of the step's
   prompts (with partial rollout, also continues the responses paused last step);
2. reward: finished groups are scored and given GRPO advantages;
3. off-policy selection: the lag queue and the replay buffer decide which groups train now;
4. the groups are shared with the replica's other ranks; old log-probs are recomputed when the
   ratio is taken against the actor (and, every ``logging.logprob_diff_interval`` steps, to
   measure the engine/actor log-prob gap);
5. train: the groups are split into ``optimizer_steps_per_rollout`` mini-batches, trained for
   ``epochs`` passes, one optimizer step (one policy version) each;
6. weight sync: the new weights are exported into the engines;
7. checkpoint, metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.logprobs import compute_logprobs
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.advantages import grpo_advantages, informative_groups
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import Config
from bapo_megatron.data.experience import (
    Group,
    ReplayBuffer,
    prompts_at,
    split_groups,
    to_policy_batch,
)
from bapo_megatron.data.task import Task, encode_prompt, load_task
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.layout import validate_layout
from bapo_megatron.rewards.pool import RewardPool
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from bapo_megatron.trainer.replicas import (
    holds_engine,
    share_from_engine_rank,
    stop_if_any_engine_failed,
)
from bapo_megatron.trainer.tracking import MetricsLogger, PhaseTimer
from bapo_megatron.trainer.warmup import run_warmup
from bapo_megatron.weights.sync import push_weights

log = logging.getLogger("bapo_megatron.train")

# Rollout statistics summed over data-parallel replicas (then turned into means).
_ROLLOUT_SUMS = ("samples", "reward", "correct", "length", "length_right", "right", "length_wrong",
                 "wrong", "truncated", "groups", "informative_groups", "reward_timeouts",
                 "reward_errors", "generated_tokens")


def train(cfg: Config, context: ParallelContext) -> None:
    """Run ``cfg`` on this rank (collective over the world); see the module docstring."""
    cfg.check_training()
    task = load_task(cfg)
    validate_layout(task.model, cfg.parallel, context.world_size)
    rollout, algo = cfg.rollout, cfg.algorithm
    if rollout.prompts_per_step % context.dp_size:
        raise ValueError(f"rollout.prompts_per_step ({rollout.prompts_per_step}) must be a multiple of "
                         f"the data-parallel size ({context.dp_size})")
    per_replica = rollout.prompts_per_step // context.dp_size
    output = Path(cfg.train.output_dir)
    if context.rank == 0:
        output.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    # weights loaded from a folder or checkpoint replace every parameter: skip the random init
    loads_weights = cfg.train.model_path is not None or cfg.train.load_checkpoint is not None
    actor = build_actor(task.model, cfg.actor, cfg.optimizer, context, initialize=not loads_weights)
    plan = SearchPlan.from_config(cfg.loss.clip)
    on_engine = holds_engine(context)
    engine = rewards = None
    if on_engine:
        engine = build_engine(rollout, task.model, model_path=cfg.train.model_path,
                              dp_rank=context.dp_rank, work_dir=output, pad_token_id=task.pad_token_id)
        rewards = RewardPool(cfg.reward.name, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s)
    replay = ReplayBuffer(algo.replay_capacity, algo.replay_max_staleness)
    state = {"step": 0, "version": 0, "position": 0, "carry": [], "lag_queue": []}

    checkpoints = output / "checkpoints"
    resume_from = latest_checkpoint(checkpoints) if cfg.checkpoint.resume else None
    if resume_from is not None:
        _, saved = load_checkpoint(resume_from, actor)
        state.update({k: saved[k] for k in state if k in saved})
        replay.load_state_dict(saved.get("replay", {"groups": []}))
        log.info("resumed from %s (rollout step %d, policy version %d)", resume_from,
                 state["step"], state["version"])
        if state["step"] >= cfg.train.steps and context.rank == 0:
            print(f"{output} already holds a run finished at rollout step {state['step']} "
                  f"(train.steps={cfg.train.steps}); raise train.steps to continue it, or give "
                  "another train.output_dir (or checkpoint.resume=false) to start over", flush=True)
    # After a resume, drop what the killed run logged past its checkpoint; a run that starts
    # afresh drops every record an earlier run left in the folder (warm-up steps are negative).
    logger = MetricsLogger(output / "tensorboard" if cfg.logging.tensorboard else None,
                           enabled=context.rank == 0, console=cfg.logging.console,
                           purge_step=-2**31 if resume_from is None else state["version"] + 1)
    if resume_from is None:
        _initial_weights(cfg, task, actor, logger)

    bucket_bytes = rollout.weight_bucket_mib * 2**20
    push_weights(actor, engine, version=state["version"], bucket_bytes=bucket_bytes)
    timer = PhaseTimer()
    rewards_seen: list[float] = []
    sampling = SamplingParams(n=rollout.samples_per_prompt, temperature=cfg.actor.temperature,
                              top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=rollout.max_new_tokens, stop_token_ids=(task.eos_token_id,))

    for step in range(state["step"], cfg.train.steps):
        timer.reset()
        version = state["version"]
        payload = failure = None
        if on_engine:
            try:
                # 1. rollout
                with timer.phase("rollout"):
                    indices = prompts_at(state["position"] + context.dp_rank * per_replica, per_replica,
                                         len(task.rows), cfg.train.seed, cfg.data.shuffle)
                    finished, state["carry"], generated = _generate(
                        engine, task, cfg, [task.rows[i] for i in indices], state["carry"], sampling,
                        seed=_seed(cfg.train.seed, step, context.dp_rank))
                # 2. reward
                with timer.phase("reward"):
                    fresh, stats = _score(finished, task, rewards, algo)
                stats["generated_tokens"] = generated
                # 3. off-policy selection
                chosen = fresh
                if algo.rollout_lag:
                    state["lag_queue"].append(fresh)
                    chosen = state["lag_queue"].pop(0) if len(state["lag_queue"]) > algo.rollout_lag else []
                if algo.replay_fraction:
                    count = round(len(chosen) * algo.replay_fraction / (1 - algo.replay_fraction))
                    draw = random.Random(_seed(cfg.train.seed, step, context.dp_rank))
                    replayed = replay.sample(count, version, draw)
                    replay.add(chosen)
                    chosen = chosen + replayed
                payload = (chosen, stats)
            except Exception as error:  # every rank stops with it, none waits for this one
                failure = error
        stop_if_any_engine_failed(failure, context, during=f"rollout step {step} (generation, rewards)")
        state["position"] += rollout.prompts_per_step
        # 4. share with the replica; old log-probs
        chosen, stats = share_from_engine_rank(payload, context)
        metrics = _rollout_metrics(stats, context)
        # a mini-batch without a group on any replica (filtered groups, partial rollouts that
        # did not finish) is skipped; one empty on some replicas only still trains on the others
        parts = split_groups(chosen, algo.optimizer_steps_per_rollout)
        groups_per_part = _sum_over_replicas([float(len(part)) for part in parts], context)
        minibatches = [to_policy_batch(part, task.pad_token_id)
                       for part, everywhere in zip(parts, groups_per_part) if everywhere]
        measure_gap = cfg.logging.logprob_diff_interval and step % cfg.logging.logprob_diff_interval == 0
        if minibatches and (algo.old_logprobs == "recompute" or measure_gap):
            with timer.phase("old_logprobs"):
                minibatches = [(_recompute(actor, batch, versions == version, cfg, metrics), versions)
                               for batch, versions in minibatches]
            _finish_gap(metrics, context)
        # 5. train (a colocated engine may give its memory to the actor meanwhile)
        if engine is not None and rollout.release_memory_during_training:
            engine.release_memory()
        last_update: dict[str, float] = {}
        trained_tokens = 0.0
        with timer.phase("train"):
            for epoch in range(algo.epochs):
                for batch, versions in minibatches:
                    step_metrics = train_step(actor, batch, cfg.loss, plan)
                    trained_tokens += step_metrics["response_tokens"]
                    last_update = step_metrics
                    step_metrics.update(_staleness(versions, state["version"], context))
                    state["version"] += 1
                    step_metrics.update(rollout_step=step, epoch=epoch)
                    logger.log(state["version"], step_metrics, console=False)
        # 6. weight sync
        if engine is not None and rollout.release_memory_during_training:
            engine.resume_memory()
        if state["version"] != version or rollout.release_memory_during_training:
            with timer.phase("weight_sync"):
                push_weights(actor, engine, version=state["version"], bucket_bytes=bucket_bytes)
        # 7. metrics, then checkpoint: a run killed in between redoes this step on resume and
        # its records from this step on are dropped (purge), so each step is logged once
        state["step"] = step + 1
        metrics.update(timer.metrics())
        metrics.update(_throughput(metrics, trained_tokens))
        metrics.update(rollout_step=step + 1, policy_version=state["version"],
                       **{"data/skipped_rows": task.skipped_rows})
        logger.log(state["version"], metrics, console=False)
        if context.rank == 0 and cfg.logging.console:  # with the last update's loss, bounds...
            print(logger.console_line(step + 1, {**last_update, **metrics}, cfg.train.steps), flush=True)
        interval = cfg.checkpoint.interval
        if step + 1 == cfg.train.steps or (interval and (step + 1) % interval == 0):
            saved = dict(state, replay=replay.state_dict())
            save_checkpoint(checkpoints, step + 1, actor, saved, keep_last=cfg.checkpoint.keep_last)
        rewards_seen.append(metrics["reward/mean"])

    if context.rank == 0 and rewards_seen:
        window = max(1, min(10, len(rewards_seen) // 2))
        first, last = rewards_seen[:window], rewards_seen[-window:]
        print(f"mean reward of the first {window} rollout steps {sum(first) / window:.3f}, "
              f"of the last {window} {sum(last) / window:.3f} "
              f"(TensorBoard: tensorboard --logdir {output / 'tensorboard'})", flush=True)
    logger.close()
    if rewards is not None:
        rewards.close()


def _initial_weights(cfg: Config, task: Task, actor, logger: MetricsLogger) -> None:
    """Weights of a run that does not resume: from the HF folder, a Megatron checkpoint, or
    random ones (the model section's seed) followed by the supervised warm-up."""
    if cfg.train.model_path is not None:
        from bapo_megatron.weights.convert import load_hf_weights
        from bapo_megatron.weights.hf_checkpoint import HFCheckpoint

        with HFCheckpoint.open(cfg.train.model_path, params_dtype=task.model.params_dtype,
                               max_position_embeddings=task.model.max_position_embeddings) as hf:
            load_hf_weights(actor.chunks, hf, actor.context)
        actor.optimizer.reload_model_params()
    elif cfg.train.load_checkpoint is not None:
        from bapo_megatron.weights.megatron_checkpoint import load_megatron_checkpoint

        load_megatron_checkpoint(actor.chunks, task.model, cfg.train.load_checkpoint)
        actor.optimizer.reload_model_params()
    elif cfg.warmup.steps:
        run_warmup(cfg, task, actor,
                   lambda step, m: logger.log(step - cfg.warmup.steps, m, console=False))


# ------------------------------------------------------------------ rollout and reward


def _seed(*parts: int) -> int:
    return random.Random("/".join(map(str, parts))).getrandbits(63)


def _generate(engine, task: Task, cfg: Config, rows, carry: list, sampling: SamplingParams, *,
              seed: int) -> tuple[list, list, int]:
    """Start ``rows``, continue ``carry`` (groups paused by the previous round), and return
    (finished groups, still-paused groups, tokens generated). A group is ``(row, samples)``;
    it finishes when all its samples have."""
    budget = cfg.rollout.partial_tokens_per_round
    before = sum(len(s.token_ids) for _, samples in carry for s in samples)
    if carry:
        paused = [s for _, samples in carry for s in samples]
        engine.continue_generation(paused, dataclasses.replace(sampling, seed=seed + 1), round_tokens=budget)
    prompts = [encode_prompt(task, row, cfg.data.system_prompt, sampling.max_new_tokens) for row in rows]
    samples = engine.generate(prompts, dataclasses.replace(sampling, seed=seed), round_tokens=budget)
    n = sampling.n
    groups = list(carry) + [(row, samples[i * n:(i + 1) * n]) for i, row in enumerate(rows)]
    finished = [g for g in groups if not any(s.resumable for s in g[1])]
    paused = [g for g in groups if any(s.resumable for s in g[1])]
    generated = sum(len(s.token_ids) for _, samples in groups for s in samples) - before
    return finished, paused, generated


def _score(finished: list, task: Task, rewards: RewardPool, algo) -> tuple[list[Group], dict[str, float]]:
    """Rewards, GRPO advantages and rollout statistics of finished groups."""
    stats = dict.fromkeys(_ROLLOUT_SUMS, 0.0)
    if not finished:
        return [], stats
    flat = [(row, s) for row, samples in finished for s in samples]
    texts = [task.tokenizer.decode(s.token_ids, skip_special_tokens=True) for _, s in flat]
    scored = rewards.score(texts, [row.answer for row, _ in flat])
    n = len(finished[0][1])
    values = torch.tensor(scored.rewards, dtype=torch.float64).reshape(len(finished), n)
    advantages = grpo_advantages(values, normalize_std=algo.normalize_std)
    keep = informative_groups(values)
    groups = [Group(prompt_id=row.id, samples=samples, rewards=values[i].tolist(),
                    advantages=advantages[i].tolist())
              for i, (row, samples) in enumerate(finished) if keep[i] or not algo.filter_equal_groups]
    lengths = torch.tensor([len(s.token_ids) for _, s in flat], dtype=torch.float64)
    right = values.reshape(-1) > 0.5
    stats.update(samples=len(flat), reward=float(values.sum()), correct=float(right.sum()),
                 length=float(lengths.sum()), length_right=float(lengths[right].sum()),
                 right=float(right.sum()), length_wrong=float(lengths[~right].sum()),
                 wrong=float((~right).sum()),
                 truncated=float(sum(s.finish_reason == "length" for _, s in flat)),
                 groups=float(len(finished)), informative_groups=float(keep.sum()),
                 reward_timeouts=float(scored.timed_out), reward_errors=float(len(scored.errors)))
    return groups, stats


# ------------------------------------------------------------------ metrics


def _sum_over_replicas(values: list[float], context: ParallelContext) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=context.device)
    if context.dp_size > 1:
        dist.all_reduce(tensor, group=context.dp_group)
    return tensor.tolist()


def _rollout_metrics(stats: dict[str, float], context: ParallelContext) -> dict[str, float]:
    totals = dict(zip(_ROLLOUT_SUMS, _sum_over_replicas([stats[k] for k in _ROLLOUT_SUMS], context)))
    samples = max(totals["samples"], 1.0)
    return {
        "reward/mean": totals["reward"] / samples,
        "reward/accuracy": totals["correct"] / samples,
        "response_length/mean": totals["length"] / samples,
        "response_length/right": totals["length_right"] / max(totals["right"], 1.0),
        "response_length/wrong": totals["length_wrong"] / max(totals["wrong"], 1.0),
        "rollout/truncated_fraction": totals["truncated"] / samples,
        "rollout/finished_groups": totals["groups"],
        "rollout/informative_groups": totals["informative_groups"],
        "rollout/generated_tokens": totals["generated_tokens"],
        "reward/timeouts": totals["reward_timeouts"],
        "reward/errors": totals["reward_errors"],
    }


def _recompute(actor, batch, current: torch.Tensor, cfg: Config, metrics: dict[str, float]):
    """``batch`` with the actor's log-probs as old log-probs (``recompute``; with
    ``loss.truncated_is_cap``, capped importance weights) or unchanged (``engine``). The
    actor/engine gap is accumulated into ``metrics`` either way, over the tokens sampled with
    the actor's current weights (``current``): on older tokens it would also hold the policy's
    own drift since they were sampled."""
    recomputed, _ = compute_logprobs(actor.chunks, batch, actor.context,
                                     micro_batch_size=cfg.actor.micro_batch_size,
                                     temperature=cfg.actor.temperature, with_entropy=False)
    mask = batch.response_mask
    same_policy = mask & current
    gap = (recomputed - batch.old_logprobs)[same_policy]
    metrics["_gap_sum"] = metrics.get("_gap_sum", 0.0) + float(gap.abs().sum())
    metrics["_gap_max"] = max(metrics.get("_gap_max", 0.0), float(gap.abs().max()) if gap.numel() else 0.0)
    metrics["_gap_tokens"] = metrics.get("_gap_tokens", 0.0) + float(same_policy.sum())
    if cfg.algorithm.old_logprobs == "engine":
        return batch
    weights = None
    if cfg.loss.truncated_is_cap is not None:
        cap = cfg.loss.truncated_is_cap
        uncapped = torch.exp(recomputed - batch.old_logprobs)
        weights = torch.where(mask, uncapped.clamp(max=cap), 0.0)
        for key, value in (("_is_sum", weights.sum()), ("_is_capped", (uncapped[mask] > cap).sum()),
                           ("_is_tokens", mask.sum())):
            metrics[key] = metrics.get(key, 0.0) + float(value)
    return dataclasses.replace(batch, old_logprobs=torch.where(mask, recomputed, 0.0), is_weights=weights)


def _finish_gap(metrics: dict[str, float], context: ParallelContext) -> None:
    total, tokens = _sum_over_replicas([metrics.pop("_gap_sum", 0.0), metrics.pop("_gap_tokens", 0.0)], context)
    largest = torch.tensor([metrics.pop("_gap_max", 0.0)], dtype=torch.float64, device=context.device)
    if context.dp_size > 1:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=context.dp_group)
    if "_is_tokens" in metrics:  # truncated importance weights (recompute with a cap)
        weighted, capped, count = _sum_over_replicas(
            [metrics.pop("_is_sum"), metrics.pop("_is_capped"), metrics.pop("_is_tokens")], context)
        metrics["is_weights/mean"] = weighted / max(count, 1.0)
        metrics["is_weights/capped_fraction"] = capped / max(count, 1.0)
    metrics["logprob_diff/tokens"] = tokens
    if tokens:
        metrics["logprob_diff/mean_abs"] = total / tokens
        metrics["logprob_diff/max_abs"] = float(largest)


def _staleness(versions: torch.Tensor, version: int, context: ParallelContext) -> dict[str, float]:
    """Policy versions between each response token's sampling and the update it trains."""
    behind = (version - versions[versions >= 0]).double()
    total, count = _sum_over_replicas([float(behind.sum()), float(behind.numel())], context)
    largest = torch.tensor([float(behind.max()) if behind.numel() else 0.0], dtype=torch.float64,
                           device=context.device)
    if context.dp_size > 1:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=context.dp_group)
    return {"staleness/mean": total / max(count, 1.0), "staleness/max": float(largest)}


def _throughput(metrics: dict[str, float], trained_tokens: float) -> dict[str, float]:
    """Tokens per second of the rollout step: generated per rollout second, trained (response
    tokens of every update, epochs counted) per train second, and generated per step second."""
    out = {}
    if metrics.get("time/rollout"):
        out["throughput/rollout_tokens_per_s"] = metrics["rollout/generated_tokens"] / metrics["time/rollout"]
    if trained_tokens and metrics.get("time/train"):
        out["throughput/train_tokens_per_s"] = trained_tokens / metrics["time/train"]
    if metrics.get("time/step"):
        out["throughput/tokens_per_s"] = metrics["rollout/generated_tokens"] / metrics["time/step"]
    return out

