"""What a training run is made of, built once before its first rollout step: the task, the
actor, each replica's engine and reward pool, the loop's state (fresh or from the latest
checkpoint), the metrics logger and the initial weights in the engines."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from bapo_megatron.actor.actor import Actor, build_actor
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import Config
from bapo_megatron.data.experience import ReplayBuffer
from bapo_megatron.data.task import Task, load_task
from bapo_megatron.distributed.context import ParallelContext
from bapo_megatron.distributed.layout import validate_layout
from bapo_megatron.rewards.pool import RewardPool
from bapo_megatron.rollout.protocol import RolloutEngine, SamplingParams
from bapo_megatron.rollout.registry import build_engine
from bapo_megatron.trainer.checkpoint import latest_checkpoint, load_checkpoint
from bapo_megatron.trainer.replicas import holds_engine
from bapo_megatron.trainer.state import TrainerState
from bapo_megatron.trainer.tracking import MetricsLogger, PhaseTimer
from bapo_megatron.trainer.warmup import run_warmup
from bapo_megatron.weights.sync import push_weights

log = logging.getLogger("bapo_megatron.train")


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

    @property
    def checkpoints(self) -> Path:
        return self.output / "checkpoints"

    @property
    def bucket_bytes(self) -> int:
        return self.cfg.rollout.weight_bucket_mib * 2**20

    def close(self) -> None:
        """Close the logger and the reward workers."""
        self.logger.close()
        if self.rewards is not None:
            self.rewards.close()


def start_run(cfg: Config, context: ParallelContext) -> Run:
    """Build the run on this rank (collective over the world), resumed from the latest
    checkpoint under ``train.output_dir`` when there is one and ``checkpoint.resume``, and with
    the policy's weights (version ``state.version``) loaded into the engines."""
    cfg.check_training()
    task = load_task(cfg)
    validate_layout(task.model, cfg.parallel, context.world_size)
    rollout, algo = cfg.rollout, cfg.algorithm
    if rollout.prompts_per_step % context.dp_size:
        raise ValueError(
            f"rollout.prompts_per_step ({rollout.prompts_per_step}) must be a multiple of "
            f"the data-parallel size ({context.dp_size})"
        )
    output = Path(cfg.train.output_dir)
    if context.rank == 0:
        output.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    # weights loaded from a folder or checkpoint replace every parameter: skip the random init
    loads_weights = cfg.train.model_path is not None or cfg.train.load_checkpoint is not None
    actor = build_actor(task.model, cfg.actor, cfg.optimizer, context, initialize=not loads_weights)
    plan = SearchPlan.from_config(cfg.loss.clip)
    engine = rewards = None
    if holds_engine(context):
        engine = build_engine(
            rollout,
            task.model,
            model_path=cfg.train.model_path,
            dp_rank=context.dp_rank,
            work_dir=output,
            pad_token_id=task.pad_token_id,
        )
        rewards = RewardPool(
            cfg.reward.name, workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s
        )
    state = TrainerState(replay=ReplayBuffer(algo.replay_capacity, algo.replay_max_staleness))
    resume_from = latest_checkpoint(output / "checkpoints") if cfg.checkpoint.resume else None
    if resume_from is not None:
        _, saved = load_checkpoint(resume_from, actor)
        state.load_checkpoint(saved, f"checkpoint {resume_from} (rank {context.rank})")
        log.info(
            "resumed from %s (rollout step %d, policy version %d)",
            resume_from,
            state.step,
            state.version,
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
    logger = MetricsLogger(
        output / "tensorboard" if cfg.logging.tensorboard else None,
        enabled=context.rank == 0,
        console=cfg.logging.console,
        purge_step=-(2**31) if resume_from is None else state.version + 1,
    )
    if resume_from is None:
        _initial_weights(cfg, task, actor, logger)
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
    )
    push_weights(actor, engine, version=state.version, bucket_bytes=run.bucket_bytes)
    return run


def _initial_weights(cfg: Config, task: Task, actor: Actor, logger: MetricsLogger) -> None:
    """Weights of a run that does not resume: from the HF folder, a Megatron checkpoint, or
    random ones (the model section's seed) followed by the supervised warm-up."""
    if cfg.train.model_path is not None:
        from bapo_megatron.weights.convert import load_hf_weights
        from bapo_megatron.weights.hf_checkpoint import HFCheckpoint

        with HFCheckpoint.open(
            cfg.train.model_path,
            params_dtype=task.model.params_dtype,
            max_position_embeddings=task.model.max_position_embeddings,
        ) as hf:
            load_hf_weights(actor.chunks, hf, actor.context)
        actor.optimizer.reload_model_params()
    elif cfg.train.load_checkpoint is not None:
        from bapo_megatron.weights.megatron_checkpoint import load_megatron_checkpoint

        load_megatron_checkpoint(actor.chunks, task.model, cfg.train.load_checkpoint)
        actor.optimizer.reload_model_params()
    elif cfg.warmup.steps:
        run_warmup(
            cfg, task, actor, lambda step, m: logger.log(step - cfg.warmup.steps, m, console=False)
        )
