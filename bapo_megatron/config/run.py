"""The run's own sections (prompts, reward, algorithm, warm-up, length and outputs, checkpoints,
logging) and the root :class:`Config` that holds every section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from bapo_megatron.config.actor import ActorConfig, OptimizerConfig
from bapo_megatron.config.kl import KLConfig
from bapo_megatron.config.loss import LossConfig
from bapo_megatron.config.model import ModelConfig, ParamsDtype
from bapo_megatron.config.parallel import ParallelConfig
from bapo_megatron.config.ranges import require_at_least
from bapo_megatron.config.rollout import RolloutConfig
from bapo_megatron.config.trackers import MlflowConfig, WandbConfig

SyntheticTask = Literal["count_to", "count_up_and_stop"]


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from: a prompt file, or the built-in synthetic task."""

    train_file: str | None = None
    """JSONL or parquet prompt set: a prompt and an answer per row (the fields
    ``prompt_key`` and ``answer_key`` name), optional ``id``, ``data_source`` and
    ``extra_info`` (:mod:`bapo_megatron.data.prompts`)."""
    prompt_key: str = "prompt"
    """Field of each row holding its prompt, a dotted path into nested objects: text, or a
    list of chat messages (``[{"role": "user", "content": ...}]``, as verl's and OpenRLHF's
    data write it) put in the chat template as they are. With the default, a row without
    ``prompt`` is read from ``problem`` (AIME-format benchmarks)."""
    answer_key: str = "answer"
    """Field of each row holding its ground-truth answer (a string or a number), a dotted path
    into nested objects: ``reward_model.ground_truth`` for verl's preprocessed data sets."""
    synthetic_task: SyntheticTask | None = None
    """Generate the prompts instead (:mod:`bapo_megatron.data.synthetic_task`): `count_to`
    ("7>12" -> "8 9 10 11 12") or `count_up_and_stop` (`count_to` upwards, warmed up on
    references that often run on past the target to the cap, so failures run long). Both bring
    their own character tokenizer; the model must then be given in the ``model`` section with
    ``vocab_size`` at least the tokenizer's."""
    synthetic_size: int = 2000
    """Prompts generated for the synthetic task."""
    skip_bad_rows: bool = False
    """Skip (and count) malformed rows of ``train_file`` instead of stopping at the first."""
    system_prompt: str | None = None
    """System turn put before every prompt in the chat template (except those given as chat
    messages with a system message of their own); None: none."""
    shuffle: bool = True
    """Visit the prompts in a seeded random order, reshuffled every epoch."""

    def __post_init__(self) -> None:
        prefix = "data"
        if (self.train_file is None) == (self.synthetic_task is None):
            raise ValueError(
                f"{prefix}: give exactly one of {prefix}.train_file and {prefix}.synthetic_task"
            )
        if self.synthetic_task not in (None, *get_args(SyntheticTask)):
            raise ValueError(
                f"{prefix}.synthetic_task must be 'count_to', 'count_up_and_stop' or null, "
                f"got {self.synthetic_task!r}"
            )
        require_at_least(self.synthetic_size, 1, f"{prefix}.synthetic_size")
        for name in ("prompt_key", "answer_key"):
            path = getattr(self, name)
            if not path or not all(part.strip() for part in path.split(".")):
                raise ValueError(
                    f"{prefix}.{name} must be a field name or a dotted path of field names "
                    f"(e.g. reward_model.ground_truth), got {path!r}"
                )


@dataclass(kw_only=True)
class RewardConfig:
    """How responses are scored: a reward from :mod:`bapo_megatron.rewards.registry`."""

    name: str = "math"
    """Registered reward (`math`, `math_lenient`, `exact_match`, `final_number`) or
    ``package.module:function``."""
    workers: int = 2
    """Processes scoring responses."""
    timeout_s: float = 10.0
    """Time limit of one check; an overrun scores 0 and is counted (its worker is replaced)."""
    batch_timeout_s: float = 120.0
    """Time limit of one rollout step's scoring on a replica: what has not finished by then
    scores 0 and is counted as timed out, so many slow checks cannot add up without bound."""

    def __post_init__(self) -> None:
        require_at_least(self.workers, 1, "reward.workers")
        for name in ("timeout_s", "batch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"reward.{name} must be a number > 0, got {getattr(self, name)!r}")


OldLogprobs = Literal["engine", "recompute"]
RoutingReplayMode = Literal["none", "trainer", "rollout"]
OffPolicyCorrection = Literal[
    "none",
    "token-truncate",
    "sequence-truncate",
    "sequence-mask",
    "token-mask",
    "icepop",
    "geometric-mask",
]
OneSampleAdvantage = Literal["zero", "reward"]


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and the off-policy data schedule (docs/algorithm.md section 6)."""

    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO); false: Dr. GRPO."""
    filter_equal_groups: bool = False
    """Drop groups whose rewards are all equal (no signal under group normalisation)."""
    one_sample_advantage: OneSampleAdvantage = "zero"
    """Advantage of a group of one sample (``rollout.samples_per_prompt=1``): `zero` (its reward
    has nothing to be compared with) or `reward`, its raw reward, as verl's GRPO gives it."""
    max_refill_rounds: int | None = None
    """Dynamic sampling with refill (DAPO), with ``filter_equal_groups``: while a replica has
    fewer groups with signal than its share of ``rollout.prompts_per_step``, it generates another
    round of that many prompts (from its refill stream of the prompt set, docs/algorithm.md
    section 6.2), at most this many rounds more per rollout step; the surplus past the share is
    dropped, and a step still short after the last round trains on the groups it has (both
    logged as ``dynamic_sampling/*``). None: no refill, the step trains on the groups kept."""
    old_logprobs: OldLogprobs = "engine"
    """Denominator of the ratio: `engine` (behaviour log-probs the engine reported) or
    `recompute` (the actor's log-probs at the start of the rollout step, the proximal policy;
    ``off_policy_correction`` then weights the loss)."""
    off_policy_correction: OffPolicyCorrection | None = None
    """Importance weight w multiplying each response token's advantage in the loss and the clip
    search, from d_t = recomputed - behaviour log-prob of token t, its sequence's sum D over the
    response tokens, and the cap C = ``loss.truncated_is_cap`` (every weighted correction needs
    ``old_logprobs=recompute``; the truncations need the cap, the masks the cap or a band):
    `none`: no weight; `token-truncate`: w_t = min(exp(d_t), C) (the decoupled objective's
    truncated behaviour weight); `sequence-truncate`: min(exp(D), C) on every token of the
    sequence; `sequence-mask`: 1 on the sequence if a <= exp(D) <= b, else 0 (rejection of
    sequences too far off-policy either way); `token-mask`: w_t = 1 if a <= exp(d_t) <= b, else
    0 (token rejection); `icepop`: w_t = exp(d_t) if a <= exp(d_t) <= b, else 0 (IcePop);
    `geometric-mask`: 1 on the sequence if a <= exp(D / n) <= b (n its response tokens), else 0.
    The band [a, b] is ``loss.mismatch_band_low`` / ``_high``, or [1/C, C] (C >= 1) when they
    are unset. None: `token-truncate` when ``loss.truncated_is_cap`` is set, else `none`
    (configs written before this field). Reported as ``off_policy/*`` every rollout step."""
    optimizer_steps_per_rollout: int = 1
    """Mini-batches each rollout batch is split into, one optimizer step each: the last one is
    trained with data that many - 1 policy versions stale."""
    epochs: int = 1
    """Passes over the rollout batch's mini-batches (PPO epochs)."""
    rollout_lag: int = 0
    """Train on the rollout batch generated this many rollout steps earlier (a queue; the
    first steps only generate): staleness by lag, as in asynchronous RL."""
    replay_fraction: float = 0.0
    """Share of each training batch's groups drawn from the replay buffer of earlier rollout
    batches (0: no replay)."""
    replay_capacity: int = 256
    """Groups the replay buffer keeps (oldest evicted first)."""
    replay_max_staleness: int = 8
    """Groups older than this many policy versions are evicted and never replayed. Counted when
    the training batch is put together: its later mini-batches and epochs train the replayed
    groups up to ``optimizer_steps_per_rollout * epochs - 1`` versions later still (the
    ``staleness/*`` metrics report what was trained)."""
    routing_replay: RoutingReplayMode = "none"
    """Mixture-of-experts models only: force the actor's routers to recorded experts in its
    training passes, so that the ratio compares the policies on the same experts. `none`: live
    routing; `trainer` (R2): the routes of the actor's own old-log-prob pass (needs
    ``old_logprobs=recompute``); `rollout` (R3): the routes the engine recorded for every token
    (the embedded engine always; vLLM and SGLang are started asking for them, see
    docs/moe.md). Missing routes (the last sampled token) are routed live."""
    kl: KLConfig | None = None
    """A frozen reference policy and a KL term towards it (None: none)."""
    max_staleness: int = 0
    """eta of asynchronous training (``rollout.placement=disaggregated``): a group trains in a
    rollout step whose policy version is v only if every token of it was sampled at version
    >= v - eta (counted from the version at the start of the step's training; its mini-batches
    add up to ``optimizer_steps_per_rollout - 1`` more, as in a synchronous run). The engines
    generate while the trainer learns and start no prompt that could not train within eta;
    groups that still exceed it are dropped and counted. 0: synchronous (generate, then
    train)."""

    def __post_init__(self) -> None:
        prefix = "algorithm"
        if self.old_logprobs not in ("engine", "recompute"):
            raise ValueError(
                f"{prefix}.old_logprobs must be 'engine' or 'recompute', got {self.old_logprobs!r}"
            )
        if self.routing_replay not in get_args(RoutingReplayMode):
            raise ValueError(
                f"{prefix}.routing_replay must be one of {list(get_args(RoutingReplayMode))}, "
                f"got {self.routing_replay!r}"
            )
        if self.one_sample_advantage not in get_args(OneSampleAdvantage):
            raise ValueError(
                f"{prefix}.one_sample_advantage must be one of "
                f"{list(get_args(OneSampleAdvantage))}, got {self.one_sample_advantage!r}"
            )
        if self.off_policy_correction not in (None, *get_args(OffPolicyCorrection)):
            raise ValueError(
                f"{prefix}.off_policy_correction must be one of "
                f"{list(get_args(OffPolicyCorrection))} or null, "
                f"got {self.off_policy_correction!r}"
            )
        for name in (
            "optimizer_steps_per_rollout",
            "epochs",
            "replay_capacity",
            "replay_max_staleness",
        ):
            require_at_least(getattr(self, name), 1, f"{prefix}.{name}")
        require_at_least(self.rollout_lag, 0, f"{prefix}.rollout_lag")
        require_at_least(self.max_staleness, 0, f"{prefix}.max_staleness")
        if self.max_refill_rounds is not None:
            require_at_least(self.max_refill_rounds, 1, f"{prefix}.max_refill_rounds")
            if not self.filter_equal_groups:
                raise ValueError(
                    f"{prefix}.max_refill_rounds={self.max_refill_rounds} refills the groups "
                    f"that {prefix}.filter_equal_groups drops, which is false: set it to true, "
                    f"or {prefix}.max_refill_rounds to null"
                )
        if not 0 <= self.replay_fraction < 1:
            raise ValueError(
                f"{prefix}.replay_fraction must lie in [0, 1), got {self.replay_fraction!r}"
            )


@dataclass(kw_only=True)
class WarmupConfig:
    """A supervised warm-up on the synthetic task's reference responses before RL, for runs that
    start from random weights (nothing can be downloaded for the tiny run). Cross-entropy on the
    response tokens, with its own Adam and learning rate."""

    steps: int = 0
    """Optimizer steps of the warm-up; 0: none."""
    lr: float = 1e-3
    """Constant learning rate of the warm-up."""
    batch_size: int = 32
    """Sequences per warm-up step, over all data-parallel ranks."""

    def __post_init__(self) -> None:
        require_at_least(self.steps, 0, "warmup.steps")
        require_at_least(self.batch_size, 1, "warmup.batch_size")
        if not self.lr > 0:
            raise ValueError(f"warmup.lr must be a number > 0, got {self.lr!r}")


@dataclass(kw_only=True)
class TrainConfig:
    """The run: how long, from which weights, and where its outputs go."""

    steps: int = 100
    """Rollout steps (each: generate, score, one or more optimizer steps, weight sync)."""
    model_path: str | None = None
    """HF folder (config.json, safetensors, tokenizer) the policy starts from; None: the
    ``model`` section's architecture with random weights (and ``warmup``)."""
    params_dtype: ParamsDtype | None = None
    """Parameter dtype for a model read from ``model_path`` (`float32`, `bfloat16`); None:
    float32."""
    max_position_embeddings: int | None = None
    """Longest prompt + response the run uses, for a model read from ``model_path`` (caps the
    engines' context too; an in-process vLLM sizes its context and CPU KV cache from the longest
    prompt and ``rollout.max_new_tokens`` within it); None: the checkpoint's
    ``max_position_embeddings``."""
    load_checkpoint: str | None = None
    """Megatron weights checkpoint the policy starts from, saved at any layout: one written by
    ``tools/convert_checkpoint.py`` or a trainer checkpoint folder (``step_*``). Its model must
    equal the ``model`` section. Only the weights are taken (a fresh optimizer, step 0); to
    continue a run, use ``checkpoint.resume``."""
    output_dir: str = "runs/bapo"
    """Run folder: ``tensorboard/``, ``metrics.jsonl`` and ``checkpoints/``."""
    seed: int = 0
    """Seed of the prompt order and the rollout sampling (each step and rank derive theirs)."""

    def __post_init__(self) -> None:
        require_at_least(self.steps, 1, "train.steps")
        require_at_least(self.seed, 0, "train.seed")
        if self.max_position_embeddings is not None:
            require_at_least(self.max_position_embeddings, 1, "train.max_position_embeddings")
        if not self.output_dir.strip():
            raise ValueError(
                f"train.output_dir must name a folder, got {self.output_dir!r} (an empty "
                "path would put the run's files in the current directory)"
            )
        if self.params_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(
                f"train.params_dtype must be 'float32', 'bfloat16' or null, "
                f"got {self.params_dtype!r}"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Trainer checkpoints (model, optimizer, schedule, RNG, data position, replay buffer,
    step, policy version), written aside and renamed into place."""

    interval: int = 0
    """Save every this many rollout steps (and after the last); 0: only after the last."""
    keep_last: int | None = 2
    """Complete checkpoints kept (older ones deleted); None keeps all."""
    resume: bool = True
    """Continue from the newest complete checkpoint in ``<output_dir>/checkpoints`` that
    verifies against its manifest (a run killed at any point resumes from its last complete
    checkpoint; a damaged one is skipped, saying why). False: start afresh, moving an earlier
    run's checkpoints aside to ``checkpoints.replaced-<time>``."""
    verify_checksums: bool = True
    """On resume, hash every file of the checkpoint against its manifest (split over the
    ranks); False checks only that every file is there with its size."""

    def __post_init__(self) -> None:
        require_at_least(self.interval, 0, "checkpoint.interval")
        if self.keep_last is not None:
            require_at_least(self.keep_last, 1, "checkpoint.keep_last")


@dataclass(kw_only=True)
class LoggingConfig:
    """Monitoring output (written by rank 0)."""

    tensorboard: bool = True
    """Write TensorBoard event files to ``<output_dir>/tensorboard``."""
    console: bool = True
    """Print one progress line per rollout step."""
    logprob_diff_interval: int = 10
    """Every this many rollout steps, recompute the actor's log-probs of the training batch to
    log the engine/actor gap over its tokens sampled with the current weights (free, and every
    step, with ``algorithm.old_logprobs=recompute``); 0: never."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """A Weights & Biases run beside TensorBoard (off by default)."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """An MLflow run beside TensorBoard (off by default)."""
    tracker_timeout_s: float = 60.0
    """Longest wait for an experiment tracker (W&B, MLflow) at the start of the run, for its run
    id at a checkpoint, and at the end. A tracker that takes longer, or fails, is reported once
    and left behind; the run goes on, and TensorBoard and ``metrics.jsonl`` keep every record."""

    def __post_init__(self) -> None:
        require_at_least(self.logprob_diff_interval, 0, "logging.logprob_diff_interval")
        if not self.tracker_timeout_s > 0:
            raise ValueError(
                f"logging.tracker_timeout_s must be a number > 0, got {self.tracker_timeout_s!r}"
            )


@dataclass(kw_only=True)
class Config:
    """Root of a run's configuration (``python -m bapo_megatron.train --config FILE.yaml``)."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    model: ModelConfig | None = None
    """The policy's architecture, for runs from random weights; None when it is read from
    ``train.model_path`` (or for runs without a model, the loss demo)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the actor is split over ranks."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The actor's optimizer and learning-rate schedule (in optimizer steps)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """How the actor runs its passes (micro-batch size, temperature, seed)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    data: DataConfig | None = None
    """Prompts; required for training."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring of responses."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the off-policy schedule."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up before RL (synthetic task only)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length, initial weights, outputs."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard, console output and experiment trackers."""

    def resolved_off_policy_correction(self) -> OffPolicyCorrection:
        """``algorithm.off_policy_correction``, or when it is unset the correction that
        ``loss.truncated_is_cap`` alone has always meant (`token-truncate` if set, else
        `none`)."""
        chosen = self.algorithm.off_policy_correction
        if chosen is not None:
            return chosen
        return "none" if self.loss.truncated_is_cap is None else "token-truncate"
