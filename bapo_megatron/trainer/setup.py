"""What a training run is made of, built once before its first rollout step: the task, the
actor, each replica's engine and reward pool, the loop's state (fresh or from the latest
checkpoint), the metrics logger and the initial weights in the engines."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from bapo_megatron.actor.actor import Actor, build_actor
from bapo_megatron.actor.optimizer import require_offload_support
from bapo_megatron.actor.reference import ReferencePolicy
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import Config, check_training
from bapo_megatron.config.checks import check_model, records_routes
from bapo_megatron.data.experience import ReplayBuffer
from bapo_megatron.data.task import Task, load_task
from bapo_megatron.disaggregated.link import EngineLink
from bapo_megatron.disaggregated.local_link import serve_in_thread
from bapo_megatron.disaggregated.server import IDLE_LIMIT
from bapo_megatron.distributed.collectives import barrier, on_every_rank
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.layout import validate_layout
from bapo_megatron.distributed.startup import RESTART_VARIABLE, restart_count
from bapo_megatron.distributed.watchdog import PhaseWatchdog
from bapo_megatron.files.lock import FolderLock, FolderLocked
from bapo_megatron.rewards.pool import RewardPool
from bapo_megatron.rollout.protocol import RolloutEngine, SamplingParams
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.trainer.checkpoint import complete_checkpoints, load_checkpoint
from bapo_megatron.trainer.checkpoint_integrity import newest_verified_checkpoint
from bapo_megatron.trainer.reference import check_reference_source, start_reference
from bapo_megatron.trainer.replicas import holds_engine
from bapo_megatron.trainer.run_summary import RunSummary
from bapo_megatron.trainer.sinks.background import start_trackers
from bapo_megatron.trainer.state import StreamProgress, TrainerState, run_identity
from bapo_megatron.trainer.tracking import MetricsLogger, PhaseTimer
from bapo_megatron.trainer.warmup import run_warmup
from bapo_megatron.weight_sync.interface import WeightSync, open_weight_sync
from bapo_megatron.weights.convert import load_hf_weights
from bapo_megatron.weights.hf_checkpoint import HFCheckpoint
from bapo_megatron.weights.megatron_checkpoint import load_megatron_checkpoint

log = logging.getLogger("bapo_megatron.train")
T = TypeVar("T")


@dataclass
class Run:
    """One rank's part of a training run."""

    cfg: Config
    context: ParallelContext
    task: Task
    actor: Actor
    plan: SearchPlan
    engine: RolloutEngine | None
    """This replica's rollout engine, on its engine rank (:func:`holds_engine`); None elsewhere."""
    rewards: RewardPool | None
    """The reward workers, on engine ranks."""
    state: TrainerState
    logger: MetricsLogger
    timer: PhaseTimer
    sampling: SamplingParams
    per_replica: int
    """Prompts each replica starts per rollout step."""
    output: Path
    lock: FolderLock | None
    """The output folder's lock, held by rank 0 for the whole run."""
    watchdog: PhaseWatchdog
    """Records this rank's phase; reports which rank is behind when a step stalls."""
    weights: WeightSync
    """How the policy's weights reach the engines (:func:`push_policy`)."""
    engines: EngineLink | None = None
    """The links to the engine ranks of a disaggregated run (None: colocated engines)."""
    stream: StreamProgress | None = None
    """Asynchronous training's admission count and last pushed version (None: synchronous)."""
    summary: RunSummary | None = None
    """What the run's last console lines sum up (rewards, bounds, time, memory); None: none."""
    reference: ReferencePolicy | None = None
    """The frozen reference policy of ``algorithm.kl`` (None: none)."""

    @property
    def checkpoints(self) -> Path:
        return self.output / "checkpoints"

    def close(self, *, failed: bool = False) -> None:
        """Close the logger (``failed``: the run ended with an error, which the experiment
        trackers record), the reward workers, the watchdog and the output folder's lock."""
        self.logger.close(failed=failed)
        if self.rewards is not None:
            self.rewards.close()
        self.watchdog.close()
        self.weights.close()
        if self.engines is not None and self.engines.local:
            self.engines.close()  # the stream server's thread and its server client
        if self.lock is not None:
            self.lock.release()


def watched(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a phase function whose first argument is the :class:`Run`: entering it records
    ``rollout step N: name`` as this rank's phase (:class:`PhaseWatchdog`)."""

    def decorate(phase: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(phase)
        def entered(run: Run, *args: Any, **kwargs: Any) -> T:
            run.watchdog.enter(f"rollout step {run.state.step}: {name}")
            return phase(run, *args, **kwargs)

        return entered

    return decorate


def push_policy(run: Run, version: int) -> None:
    """The actor's weights into the engines as policy ``version`` (collective over the trainer
    world), by the run's weight sync (:mod:`bapo_megatron.weight_sync`)."""
    run.weights.push(version)


def _open_weight_sync(
    cfg: Config, actor: Actor, engine: RolloutEngine | None, engines: EngineLink | None
) -> WeightSync:
    """This rank's weight sync: into its replica's engine (``engine``, or the engine links'
    streaming client), over the engine links' stage broadcasts when the engines run on ranks of
    their own."""
    if engine is None and engines is not None:
        engine = engines.stream
    return open_weight_sync(
        actor,
        engine,
        weight_transport=cfg.rollout.weight_transport,
        engine_ranks=engines is not None and not engines.local,
        stage=engines.weights if engines is not None else None,
        bucket_bytes=cfg.rollout.weight_bucket_mib * 2**20,
        timeout=datetime.timedelta(seconds=cfg.parallel.collective_timeout_s),
    )


def start_run(cfg: Config, context: ParallelContext, engines: EngineLink | None = None) -> Run:
    """Build the run on this rank (collective over the world), resumed from the newest
    checkpoint under ``train.output_dir`` that verifies, when there is one and
    ``checkpoint.resume``, and with the policy's weights (version ``state.version``) loaded into
    the engines. ``engines``: the links to a disaggregated run's engine ranks (None: each
    replica builds its colocated engine). Rank 0 holds the output folder's lock until
    :meth:`Run.close`."""
    check_training(cfg)
    output = Path(cfg.train.output_dir)
    lock = _lock_output(output, context, cfg.parallel.startup_timeout_s)
    try:
        return _build_run(cfg, context, output, lock, engines)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _build_run(
    cfg: Config,
    context: ParallelContext,
    output: Path,
    lock: FolderLock | None,
    engines: EngineLink | None,
) -> Run:
    watchdog = PhaseWatchdog(
        _process_group_store(context),
        context.rank,
        context.world_size,
        stall_s=cfg.parallel.stall_report_s,
    )
    if context.world_size > 1:  # one process has no peer to wait for: no thread
        watchdog.start()
    watchdog.enter("setup")
    check_reference_source(cfg)
    task = load_task(cfg)
    check_model(cfg, task.model)  # a model read from train.model_path is known only now
    validate_layout(task.model, cfg.parallel, context.world_size)
    # Before the model is built (build_optimizer checks it again for callers without setup).
    require_offload_support(cfg.optimizer, cfg.parallel.device)
    rollout, algo = cfg.rollout, cfg.algorithm
    if rollout.prompts_per_step % context.dp_size:
        raise ValueError(
            f"rollout.prompts_per_step ({rollout.prompts_per_step}) must be a multiple of "
            f"the data-parallel size ({context.dp_size})"
        )
    if rollout.placement == "disaggregated" and rollout.engine_ranks and engines is None:
        raise ValueError(
            "rollout.placement=disaggregated needs engine ranks: start the run with "
            "python -m bapo_megatron.train under torchrun (rollout.engine_ranks of its ranks "
            "run the engines)"
        )
    if rollout.placement == "colocated" and engines is not None:
        raise ValueError("rollout.placement=colocated: links to engine ranks were given")
    # weights loaded from a folder or checkpoint replace every parameter: skip the random init
    loads_weights = cfg.train.model_path is not None or cfg.train.load_checkpoint is not None
    actor = build_actor(task.model, cfg.actor, cfg.optimizer, context, initialize=not loads_weights)
    plan = SearchPlan.from_config(cfg.loss.clip)
    engine = rewards = None
    if holds_engine(context) and engines is not None:
        engine = engines.engine
    elif holds_engine(context):
        engine = build_engine(
            rollout,
            task.model,
            model_path=cfg.train.model_path,
            dp_rank=context.dp_rank,
            work_dir=output,
            pad_token_id=task.pad_token_id,
            device=str(context.device),
            record_routes=records_routes(cfg, task.model),
            longest_prompt_tokens=task.longest_prompt_tokens,
        )
    if holds_engine(context) and algo.max_staleness and engines is None:
        # servers as the engines of asynchronous training: driven from a thread of this rank
        timeout = datetime.timedelta(seconds=rollout.timeout_s or IDLE_LIMIT.total_seconds())
        engines = EngineLink(
            engine=None,
            weights=None,
            stream=serve_in_thread(
                engine,
                inflight_update=rollout.inflight_update,
                timeout=timeout,
                name=f"rollout engine {rollout.engine!r} of data-parallel replica "
                f"{context.dp_rank}",
            ),
            local=True,
        )
        engine = None
    elif algo.max_staleness and engines is None:
        engines = EngineLink(engine=None, weights=None, local=True)
    if holds_engine(context):
        rewards = RewardPool(
            cfg.reward.name,
            workers=cfg.reward.workers,
            timeout_s=cfg.reward.timeout_s,
            batch_timeout_s=cfg.reward.batch_timeout_s,
        )
    state = TrainerState(replay=ReplayBuffer(algo.replay_capacity, algo.replay_max_staleness))
    checkpoints = output / "checkpoints"
    resume_from = None
    if cfg.checkpoint.resume:
        resume_from = newest_verified_checkpoint(
            complete_checkpoints(checkpoints), checksums=cfg.checkpoint.verify_checksums
        )
    else:
        _move_aside(checkpoints, context)
    if resume_from is not None:
        _, saved = load_checkpoint(resume_from, actor, identity=run_identity(cfg))
        state.load_checkpoint(saved, f"checkpoint {resume_from} (rank {context.rank})")
        log.info(
            "resumed from %s (rollout step %d, policy version %d)",
            resume_from,
            state.step,
            state.version,
        )
    if RESTART_VARIABLE in os.environ:
        # under torchrun, which may have restarted the worker group in place (the count is this
        # node's: a node restarted because another's workers failed keeps its count)
        log.info(
            "rank %d: torchrun restart count %d (%s): %s",
            context.rank,
            restart_count(),
            RESTART_VARIABLE,
            f"resumed from {resume_from}" if resume_from else "no checkpoint to resume from",
        )
    if state.step >= cfg.train.steps and context.rank == 0:
        print(
            f"{output} already holds a run finished at rollout step {state.step} "
            f"(train.steps={cfg.train.steps}); raise train.steps to continue it, or give "
            "another train.output_dir (or checkpoint.resume=false) to start over",
            flush=True,
        )
    # After a resume, drop what the killed run logged past its checkpoint; a run that starts
    # afresh drops every record an earlier run left in the folder (warm-up steps are negative).
    # The experiment trackers reopen the runs the checkpoint names (a fresh start opens new ones).
    trackers = (
        start_trackers(cfg.logging, dataclasses.asdict(cfg), output, state.tracker_runs)
        if context.rank == 0
        else []
    )
    logger = None
    try:
        logger = MetricsLogger(
            output / "tensorboard" if cfg.logging.tensorboard else None,
            enabled=context.rank == 0,
            console=cfg.logging.console,
            purge_step=-(2**31) if resume_from is None else state.version + 1,
            trackers=trackers,
        )
        if resume_from is None:
            _initial_weights(cfg, task, actor, logger)
        reference = start_reference(cfg, task, actor, output, resumed=resume_from is not None)
        sampling = SamplingParams(
            n=rollout.samples_per_prompt,
            temperature=cfg.actor.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            stop_token_ids=(task.eos_token_id,),
        )
        run = Run(
            cfg=cfg,
            context=context,
            task=task,
            actor=actor,
            plan=plan,
            engine=engine,
            rewards=rewards,
            state=state,
            logger=logger,
            timer=PhaseTimer(),
            sampling=sampling,
            per_replica=rollout.prompts_per_step // context.dp_size,
            output=output,
            lock=lock,
            watchdog=watchdog,
            weights=_open_weight_sync(cfg, actor, engine, engines),
            engines=engines,
            reference=reference,
        )
        push_policy(run, state.version)
        if algo.max_staleness:
            run.stream = StreamProgress(next_item=state.step, pushed_version=state.version)
        return run
    except BaseException:
        # a tracker run that began is marked failed, not left open by a run that never started
        if logger is not None:
            logger.close(failed=True)
        else:
            for tracker in trackers:
                tracker.close(failed=True)
        raise


def _initial_weights(cfg: Config, task: Task, actor: Actor, logger: MetricsLogger) -> None:
    """Weights of a run that does not resume: from the HF folder, a Megatron checkpoint, or
    random ones (the model section's seed) followed by the supervised warm-up."""
    if cfg.train.model_path is not None:
        with HFCheckpoint.open(
            cfg.train.model_path,
            params_dtype=task.model.params_dtype,
            max_position_embeddings=task.model.max_position_embeddings,
        ) as hf:
            load_hf_weights(actor.chunks, hf, actor.context)
        actor.optimizer.reload_model_params()
    elif cfg.train.load_checkpoint is not None:
        load_megatron_checkpoint(actor.chunks, task.model, cfg.train.load_checkpoint)
        actor.optimizer.reload_model_params()
    elif cfg.warmup.steps:
        run_warmup(
            cfg, task, actor, lambda step, m: logger.log(step - cfg.warmup.steps, m, console=False)
        )


def _lock_output(output: Path, context: ParallelContext, wait_s: float) -> FolderLock | None:
    """Rank 0 creates ``output`` and takes its lock; every rank raises ``ValueError`` naming the
    folder if that fails (another run holds it, or the folder cannot be written). Under torchrun
    the lock names the job (``TORCHELASTIC_RUN_ID``): after a restart in place, the dead
    attempt's rank 0 may still be ending, and is waited for up to ``wait_s``."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    lock = FolderLock(output, "training run", job=job) if context.rank == 0 else None

    def take() -> None:
        if lock is not None:
            lock.acquire(same_job_wait_s=wait_s)

    on_every_rank(
        take,
        where=f"train.output_dir {output}",
        catch=(FolderLocked, OSError),
        error_type=ValueError,
        describe=str,
    )
    return lock


def _move_aside(checkpoints: Path, context: ParallelContext) -> None:
    """A run that starts afresh moves the checkpoints an earlier run left in its folder to
    ``checkpoints.replaced-<UTC time>``: a later resume must never pick up that run's history,
    and nothing is deleted."""
    if context.rank == 0 and checkpoints.is_dir() and any(checkpoints.iterdir()):
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%f")
        aside = checkpoints.with_name(f"checkpoints.replaced-{stamp}")
        checkpoints.rename(aside)
        log.warning("checkpoint.resume=false: moved the earlier run's checkpoints to %s", aside)
    barrier()


def _process_group_store(context: ParallelContext) -> dist.Store | None:
    """The key-value store the world's process group was set up with (torchrun's rendezvous
    store), for the phase watchdog; None in a one-process run."""
    if context.world_size == 1:
        return None
    return dist.distributed_c10d._get_default_store()
