"""The RL training loop, started by :mod:`bapo_megatron.trainer.main`.

One rollout step, top to bottom in :func:`rollout_step`:

1. rollout: each model replica's engine (on its first rank) generates its share of the step's
   prompts (with partial rollout, also continues the responses paused last step);
2. reward: finished groups are scored and given GRPO advantages (with dynamic sampling, more
   prompts are generated while too few groups carry signal, :mod:`~bapo_megatron.trainer.refill`);
3. off-policy selection: the lag queue and the replay buffer decide which groups train now;
4. old log-probs: the groups are shared with the replica's other ranks; old log-probs are
   recomputed when the ratio is taken against the actor (and, every
   ``logging.logprob_diff_interval`` steps, to measure the engine/actor log-prob gap);
5. train: the groups are split into ``optimizer_steps_per_rollout`` mini-batches, trained for
   ``epochs`` passes, one optimizer step (one policy version) each;
6. weight sync: the new weights are exported into the engines;
7. metrics, then checkpoint.

Asynchronous training (``algorithm.max_staleness`` >= 1) swaps two phases for those of
:mod:`~bapo_megatron.trainer.async_rollout`: 1. admits the items the engines may start ahead
and takes this step's, 6. sends the weights without waiting for the engines to load them.

Phases 1-3 run on the engine ranks (:mod:`~bapo_megatron.trainer.phases`); an engine failure
there, or in the engine calls of phases 5-6, stops every rank with :class:`EngineFailure`.
"""

from __future__ import annotations

from bapo_megatron.actor.train_step import train_step
from bapo_megatron.config import Config
from bapo_megatron.disaggregated.link import EngineLink
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.trainer.async_rollout import send_weights, take_rollout, weight_update_metrics
from bapo_megatron.trainer.checkpoint import save_checkpoint
from bapo_megatron.trainer.metrics import staleness, throughput
from bapo_megatron.trainer.phases import (
    Minibatch,
    generate,
    old_logprobs,
    score,
    select_off_policy,
)
from bapo_megatron.trainer.refill import refill
from bapo_megatron.trainer.replicas import call_engine, engine_failures_stop_every_rank
from bapo_megatron.trainer.run_summary import RunSummary
from bapo_megatron.trainer.setup import Run, push_policy, start_run, watched
from bapo_megatron.trainer.state import run_identity


def train(cfg: Config, context: ParallelContext, engines: EngineLink | None = None) -> None:
    """Run ``cfg`` on this rank (collective over the world); see the module docstring.
    ``engines``: the links to a disaggregated run's engine ranks (None: colocated engines)."""
    clip = cfg.loss.clip
    summary = RunSummary(c_low=clip.c_low_start, c_high=clip.c_high_start)  # clock starts now
    run = start_run(cfg, context, engines)
    run.summary = summary
    try:
        for step in range(run.state.step, cfg.train.steps):
            summary.rewards.append(rollout_step(run, step))
    except Exception as error:
        # a collective that timed out names only itself: add where every rank is
        run.watchdog.annotate(error)
        run.close(failed=True)
        raise
    if context.rank == 0 and summary.rewards:
        for line in summary.lines(_target_share(run)):
            print(line, flush=True)
        print(f"TensorBoard: tensorboard --logdir {run.output / 'tensorboard'}", flush=True)
    run.close()


def _target_share(run: Run) -> float | None:
    """The bound search's target share rho0 (None for a fixed clip or a ratio target)."""
    clip = run.cfg.loss.clip
    return None if run.plan.is_fixed or clip.target_unit != "share" else clip.target


def rollout_step(run: Run, step: int) -> float:
    """Rollout step ``step`` (counting from 0), its 7 phases in order; returns its mean reward."""
    run.timer.reset()
    start_version = run.state.version
    with engine_failures_stop_every_rank(
        run.context, during=f"rollout step {step} (generation, rewards)"
    ):
        rollout = take_rollout(run, step) if run.stream else generate(run, step)  # 1. rollout
        fresh = refill(run, score(run, rollout), step)  # 2. reward (and refill rounds)
        experience = select_off_policy(run, fresh, step)  # 3. off-policy selection
    minibatches, metrics = old_logprobs(run, experience, step)  # 4. old log-probs
    last_update, trained_tokens = train_minibatches(run, minibatches, step)  # 5. train
    send_weights(run) if run.stream else sync_weights(run, start_version, step)  # 6. weight sync
    record_step(run, step, metrics, last_update, trained_tokens)  # 7. metrics, checkpoint
    return metrics["reward/mean"]


@watched("5. train")
def train_minibatches(
    run: Run, minibatches: list[Minibatch], step: int
) -> tuple[dict[str, float], float]:
    """5. ``algorithm.epochs`` passes over the mini-batches, one optimizer step (one policy
    version) each, each logged; a colocated engine may give its memory to the actor meanwhile.
    Returns the last update's metrics and the response tokens trained (epochs counted)."""
    if run.cfg.rollout.release_memory_during_training:
        call_engine(
            run.engine,
            lambda engine: engine.release_memory(),
            run.context,
            during=f"engine.release_memory() before training at rollout step {step}",
        )
    last_update: dict[str, float] = {}
    trained_tokens = 0.0
    algo = run.cfg.algorithm
    # asynchronous: the share of tokens each number of versions behind, up to the most possible
    bins = algo.max_staleness + algo.optimizer_steps_per_rollout if algo.max_staleness else 0
    # recomputed old log-probs are the current weights' until the first update: ratio 1 exactly
    recomputed_at = run.state.version if algo.old_logprobs == "recompute" else None
    with run.timer.phase("train"):
        for epoch in range(run.cfg.algorithm.epochs):
            for batch, versions in minibatches:
                update = train_step(
                    run.actor,
                    batch,
                    run.cfg.loss,
                    run.plan,
                    ratios_are_one=run.state.version == recomputed_at,
                    kl=run.cfg.algorithm.kl,
                )
                trained_tokens += update["response_tokens"]
                last_update = update
                update.update(
                    staleness(versions, run.state.version, run.context, histogram_bins=bins)
                )
                run.state.version += 1
                update.update(rollout_step=step, epoch=epoch)
                if run.summary is not None:
                    run.summary.add_update(update, _target_share(run))
                run.logger.log(run.state.version, update, console=False)
    return last_update, trained_tokens


@watched("6. weight sync")
def sync_weights(run: Run, start_version: int, step: int) -> None:
    """6. The new policy into the engines (and their memory back, if it was released)."""
    released = run.cfg.rollout.release_memory_during_training
    if released:
        call_engine(
            run.engine,
            lambda engine: engine.resume_memory(),
            run.context,
            during=f"engine.resume_memory() after training at rollout step {step}",
        )
    if run.state.version != start_version or released:
        with run.timer.phase("weight_sync"):
            push_policy(run, run.state.version)


@watched("7. metrics, checkpoint")
def record_step(
    run: Run,
    step: int,
    metrics: dict[str, float],
    last_update: dict[str, float],
    trained_tokens: float,
) -> None:
    """7. The step's metrics, then (every ``checkpoint.interval`` steps and at the end) a
    checkpoint: a run killed in between redoes this step on resume and its records from this
    step on are dropped (purge), so each step is logged once."""
    cfg, state = run.cfg, run.state
    state.step = step + 1
    metrics.update(run.timer.metrics())
    metrics.update(throughput(metrics, trained_tokens))
    if run.stream:
        metrics.update(weight_update_metrics(run))
    metrics.update(
        rollout_step=step + 1,
        policy_version=state.version,
        **{"data/skipped_rows": run.task.skipped_rows},
    )
    run.logger.log(state.version, metrics, console=False)
    if run.context.rank == 0 and cfg.logging.console:  # with the last update's loss, bounds...
        print(
            run.logger.console_line(step + 1, {**last_update, **metrics}, cfg.train.steps),
            flush=True,
        )
    interval = cfg.checkpoint.interval
    if step + 1 == cfg.train.steps or (interval and (step + 1) % interval == 0):
        state.tracker_runs = run.logger.tracker_runs()  # rank 0's; {} elsewhere
        save_checkpoint(
            run.checkpoints,
            step + 1,
            run.actor,
            state.to_checkpoint(),
            keep_last=cfg.checkpoint.keep_last,
            identity=run_identity(cfg),
        )
