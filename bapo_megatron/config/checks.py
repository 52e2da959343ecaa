"""The rules that span sections: what a :class:`~bapo_megatron.config.run.Config` needs to drive
a training run. Each section checks its own fields when it is built; these rules are checked
only for training (the loss demo loads configs without the sections a run needs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bapo_megatron.config.parallel import fp8_length_multiple

MASKING_CORRECTIONS = ("sequence-mask", "token-mask", "icepop", "geometric-mask")
"""The off-policy corrections that mask what lies outside a band (``loss.mismatch_band_*``)."""
SPREAD_ENGINES = ("vllm", "sglang")
"""In-process engines that ``rollout.engine_tensor_parallel_size`` spreads over several
devices."""

if TYPE_CHECKING:
    from bapo_megatron.config.model import ModelConfig
    from bapo_megatron.config.run import Config


def check_training(cfg: Config) -> None:
    """Raise ``ValueError`` naming the fields when ``cfg`` cannot drive a training run."""
    _check_sources(cfg)
    if cfg.rollout.engine not in SPREAD_ENGINES and cfg.rollout.engine_tensor_parallel_size > 1:
        raise ValueError(
            f"rollout.engine_tensor_parallel_size={cfg.rollout.engine_tensor_parallel_size} "
            f"spreads an in-process engine over several devices, which only {list(SPREAD_ENGINES)} "
            f"do; rollout.engine={cfg.rollout.engine!r} runs in one process (set it to 1; a "
            "server engine's tensor parallelism is set where the server starts)"
        )
    _check_off_policy_correction(cfg)
    _check_overlong(cfg)
    _check_experts(cfg)
    _check_schedule(cfg)
    _check_placement(cfg)
    _check_quantization(cfg)
    _check_asynchronous(cfg)
    _check_packing(cfg)
    _check_refill(cfg)


def _check_refill(cfg: Config) -> None:
    """A refill round generates whole groups at once: partial rollout's paused groups would
    mix rounds and steps."""
    rounds = cfg.algorithm.max_refill_rounds
    if rounds is not None and cfg.rollout.partial_tokens_per_round is not None:
        raise ValueError(
            f"algorithm.max_refill_rounds={rounds} with rollout.partial_tokens_per_round="
            f"{cfg.rollout.partial_tokens_per_round}: refill rounds generate whole groups, "
            "partial rollout pauses them; set one of them to null"
        )


def _check_packing(cfg: Config) -> None:
    """Packed rows need a layout that can run them and token budgets that hold the shortest
    packed sequence (the layout's length multiple)."""
    actor, parallel = cfg.actor, cfg.parallel
    if not actor.pack_sequences:
        return
    if parallel.context_parallel_size > 1:
        raise ValueError(
            "actor.pack_sequences=true with parallel.context_parallel_size="
            f"{parallel.context_parallel_size}: context parallelism needs each packed sequence "
            "split into 2 x CP chunks over the CP ranks, which this actor does not do; turn "
            "packing off or context parallelism off"
        )
    multiple = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    multiple *= fp8_length_multiple(parallel)
    for name in ("max_tokens_per_microbatch", "logprob_max_tokens_per_microbatch"):
        budget = getattr(actor, name)
        if budget is not None and budget < multiple:
            raise ValueError(
                f"actor.{name}={budget} is below the layout's length multiple {multiple} "
                "(parallel.tensor_model_parallel_size under sequence parallelism, times what "
                "parallel.fp8_recipe needs): no row fits"
            )


def _check_experts(cfg: Config) -> None:
    """The checks of :func:`check_model` for the model section (a model read from
    ``train.model_path`` is checked once the trainer has read it)."""
    if cfg.model is not None:
        check_model(cfg, cfg.model)


def check_model(cfg: Config, model: ModelConfig) -> None:
    """What the run asks of ``model``: :func:`check_experts`, and attention heads that split
    over the in-process engine's devices (:func:`check_engine_heads`)."""
    check_experts(cfg, model)
    if cfg.rollout.engine in SPREAD_ENGINES:
        check_engine_heads(model, cfg.rollout.engine_tensor_parallel_size)


def check_engine_heads(
    model: ModelConfig,
    tensor_parallel_size: int,
    field: str = "rollout.engine_tensor_parallel_size",
) -> None:
    """vLLM's and SGLang's rule for splitting attention over ``tensor_parallel_size`` workers:
    the query heads divide evenly; key/value heads divide evenly, or, when fewer than the
    workers, divide the workers (each is then replicated on several of them). ``ValueError``
    naming ``field``."""
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"{field} must be at least 1, got {tp}")
    heads, kv_heads = model.num_attention_heads, model.num_query_groups
    if heads % tp:
        raise ValueError(
            f"{field}={tp} must divide the model's {heads} attention heads "
            "(the engine gives every worker the same number of query heads)"
        )
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(
            f"{field}={tp} must divide the model's {kv_heads} key/value heads, as there are "
            "at least as many of them as workers"
        )
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(
            f"{field}={tp} must be a multiple of the model's {kv_heads} key/value heads, which "
            "the engine replicates over the workers when they are fewer"
        )


def records_routes(cfg: Config, model: ModelConfig) -> bool:
    """Whether the rollout engine must return the experts of every token: routing replay of the
    rollout (`rollout`, R3) on a mixture-of-experts ``model`` (the embedded engine records them
    for every such model; vLLM and SGLang only when asked, which costs them)."""
    return model.is_moe and cfg.algorithm.routing_replay == "rollout"


def check_experts(cfg: Config, model: ModelConfig) -> None:
    """Routing replay and what a mixture-of-experts ``model`` needs of the rest of the run;
    ``ValueError`` naming the fields."""
    replay = cfg.algorithm.routing_replay
    if replay != "none" and not model.is_moe:
        raise ValueError(
            f"algorithm.routing_replay={replay!r} replays expert routes, but model.model_type "
            f"{model.model_type!r} has no experts (set it to 'none')"
        )
    if replay == "trainer" and cfg.algorithm.old_logprobs != "recompute":
        raise ValueError(
            "algorithm.routing_replay='trainer' replays the routes of the actor's old-log-prob "
            "pass, which needs algorithm.old_logprobs=recompute"
        )
    if not model.is_moe:
        return
    parallel = cfg.parallel
    etp = parallel.expert_tensor_parallel_size
    tp_cp = parallel.tensor_model_parallel_size * parallel.context_parallel_size
    if cfg.rollout.placement == "colocated" and tp_cp % etp:
        # Megatron numbers expert-TP ranks tp-first: replica d's engine rank (global rank
        # d x TP x CP of its stage) holds whole experts only where expert-TP divides TP x CP
        raise ValueError(
            f"parallel.expert_tensor_parallel_size={etp} must divide "
            "parallel.tensor_model_parallel_size x parallel.context_parallel_size "
            f"(= {tp_cp}) in a colocated run: each replica's engine rank must be expert-TP "
            "rank 0, where the weight sync gathers whole experts"
        )


def _check_asynchronous(cfg: Config) -> None:
    """What asynchronous training (``algorithm.max_staleness`` >= 1) needs and excludes."""
    rollout, algorithm = cfg.rollout, cfg.algorithm
    eta = algorithm.max_staleness
    if not eta:
        if rollout.sync_interval != 1:
            raise ValueError(
                f"rollout.sync_interval={rollout.sync_interval} applies to asynchronous training "
                "(algorithm.max_staleness >= 1); a synchronous run pushes every rollout step"
            )
        return
    if rollout.placement != "disaggregated":
        raise ValueError(
            f"algorithm.max_staleness={eta} trains while the engines generate, which needs "
            "rollout.placement=disaggregated (engines on ranks of their own); colocated engines "
            "share the trainer's ranks (set algorithm.max_staleness=0)"
        )
    for name, value in (
        ("rollout.partial_tokens_per_round", rollout.partial_tokens_per_round),
        ("algorithm.rollout_lag", algorithm.rollout_lag or None),
        ("algorithm.replay_fraction", algorithm.replay_fraction or None),
    ):
        if value is not None:
            raise ValueError(
                f"{name}={value} imitates staleness in a synchronous run; with "
                f"algorithm.max_staleness={eta} the staleness is real (set {name} off)"
            )
    if rollout.sync_interval > eta + 1:
        raise ValueError(
            f"rollout.sync_interval={rollout.sync_interval} leaves the engines up to "
            f"{rollout.sync_interval - 1} versions behind, more than algorithm.max_staleness="
            f"{eta} allows: every group would be dropped (use at most {eta + 1})"
        )
    if rollout.inflight_update == "continue" and rollout.engine != "embedded":
        raise ValueError(
            f"rollout.inflight_update=continue loads weights between two tokens, which only "
            f"the embedded engine offers; rollout.engine={rollout.engine!r} takes "
            "rollout.inflight_update=resume"
        )


def _check_off_policy_correction(cfg: Config) -> None:
    """That a weighted correction has what its weight is made of: proximal log-probs recomputed
    by the actor (compared with the behaviour ones) and a cap, or for a mask a band."""
    chosen, cap = cfg.algorithm.off_policy_correction, cfg.loss.truncated_is_cap
    masks = chosen in MASKING_CORRECTIONS
    if cfg.loss.mismatch_band() is not None and not masks:
        named = "unset" if chosen is None else chosen
        raise ValueError(
            "loss.mismatch_band_low/_high set a masking band, but "
            f"algorithm.off_policy_correction={named} masks nothing (the band is for "
            f"{list(MASKING_CORRECTIONS)})"
        )
    if chosen is None:  # configs without the field: the cap alone means token-truncate
        if cap is not None and cfg.algorithm.old_logprobs != "recompute":
            raise ValueError(
                "loss.truncated_is_cap needs algorithm.old_logprobs=recompute (the "
                "weight is exp(recomputed - behaviour))"
            )
        return
    if chosen == "none":
        if cap is not None:
            raise ValueError(
                f"loss.truncated_is_cap={cap} caps an importance weight, but "
                "algorithm.off_policy_correction=none puts none on the loss (choose a correction "
                "or set loss.truncated_is_cap=null)"
            )
        return
    if cfg.algorithm.old_logprobs != "recompute":
        raise ValueError(
            f"algorithm.off_policy_correction={chosen} needs algorithm.old_logprobs=recompute, "
            f"got {cfg.algorithm.old_logprobs!r}: its weight compares the actor's recomputed "
            "(proximal) log-probs with the engine's behaviour ones"
        )
    if masks and cfg.loss.mismatch_band() is not None:
        return  # the band is checked by the loss section
    if cap is None:
        needs = "or loss.mismatch_band_low/_high, its band" if masks else "the cap of its weight"
        raise ValueError(
            f"algorithm.off_policy_correction={chosen} needs loss.truncated_is_cap ({needs}; "
            "e.g. 2.0)"
        )
    unit = "tokens" if chosen in ("token-mask", "icepop") else "sequences"
    if masks and cap < 1:
        raise ValueError(
            f"algorithm.off_policy_correction={chosen} keeps the {unit} whose weight lies in "
            f"[1/C, C] with C = loss.truncated_is_cap={cap}: below 1 that range is empty and "
            "everything would be masked (use a cap >= 1, or set loss.mismatch_band_low/_high)"
        )


def _check_overlong(cfg: Config) -> None:
    """The overlong penalty's buffer lies inside the response length cap; the KL reward
    penalty recomputes whole groups' advantages, which the overlong filter has cut."""
    buffer, cap = cfg.loss.overlong.buffer_length, cfg.rollout.max_new_tokens
    if buffer > cap:
        raise ValueError(
            f"loss.overlong.buffer_length={buffer} is longer than the responses may be "
            f"(rollout.max_new_tokens={cap}): the buffer ends at the cap and must fit below it"
        )
    kl = cfg.algorithm.kl
    if cfg.loss.overlong.filter and kl is not None and kl.placement == "reward":
        raise ValueError(
            "loss.overlong.filter=true with algorithm.kl.placement='reward': the KL penalty "
            "recomputes each group's advantages after the filter has removed its truncated "
            "samples, so they would be normalised over another group than without the KL; "
            "use algorithm.kl.placement='loss', or no overlong filter"
        )


def _check_placement(cfg: Config) -> None:
    """What a disaggregated run (engines on ranks of their own) cannot do yet, or at all."""
    rollout = cfg.rollout
    if rollout.placement != "disaggregated":
        return
    if rollout.release_memory_during_training:
        raise ValueError(
            "rollout.release_memory_during_training frees a colocated engine's memory for the "
            "actor; with rollout.placement=disaggregated the engine has its own ranks (set it "
            "to false)"
        )


def _check_quantization(cfg: Config) -> None:
    """A quantized engine needs a CUDA GPU (``auto`` is checked when the engine starts)."""
    quantization = cfg.rollout.quantization
    if quantization is not None and cfg.parallel.device == "cpu":
        raise ValueError(
            f"rollout.quantization={quantization!r} needs the engine on a CUDA GPU with FP8, "
            "but parallel.device is 'cpu' (vLLM's CPU build has no FP8; set "
            "rollout.quantization=null)"
        )


def _check_sources(cfg: Config) -> None:
    """Where prompts, the architecture and the initial weights come from."""
    if cfg.data is None:
        raise ValueError(
            "data: a training run needs a data section (data.train_file or data.synthetic_task)"
        )
    if (cfg.model is None) == (cfg.train.model_path is None):
        raise ValueError(
            "give exactly one of the model section (random initial weights) and "
            "train.model_path (an HF folder)"
        )
    if cfg.data.synthetic_task is not None and cfg.model is None:
        raise ValueError(
            "data.synthetic_task brings its own tokenizer, so the model must be "
            "given in the model section, not train.model_path"
        )
    if cfg.train.load_checkpoint is not None and cfg.model is None:
        raise ValueError(
            "train.load_checkpoint needs the model section (the architecture the "
            "checkpoint's weights must match)"
        )
    if cfg.warmup.steps and cfg.train.load_checkpoint is not None:
        raise ValueError(
            "warmup.steps > 0 trains random initial weights; with "
            "train.load_checkpoint set warmup.steps=0"
        )
    if cfg.warmup.steps and cfg.data.synthetic_task is None:
        raise ValueError(
            "warmup.steps > 0 needs data.synthetic_task (the warm-up trains on "
            "its reference responses)"
        )
    for name in ("params_dtype", "max_position_embeddings"):
        if getattr(cfg.train, name) is not None and cfg.train.model_path is None:
            raise ValueError(
                f"train.{name} applies to train.model_path; with a model section set model.{name}"
            )


def _check_schedule(cfg: Config) -> None:
    """That the rollout batches, their groups and the off-policy schedule can train at all."""
    rollout, algorithm = cfg.rollout, cfg.algorithm
    if rollout.samples_per_prompt < 2 and algorithm.one_sample_advantage == "zero":
        raise ValueError(
            f"rollout.samples_per_prompt={rollout.samples_per_prompt} cannot train: GRPO "
            "advantages compare each response with the other responses to its prompt (reward "
            "minus the group's mean), so a group of one gives every response the advantage 0 (and "
            "nan once divided by its standard deviation); use at least 2, or "
            "algorithm.one_sample_advantage=reward (its raw reward, as verl gives it)"
        )
    steps = algorithm.optimizer_steps_per_rollout
    if rollout.prompts_per_step % steps:
        raise ValueError(
            f"rollout.prompts_per_step ({rollout.prompts_per_step}) must be a "
            f"multiple of algorithm.optimizer_steps_per_rollout ({steps}): each "
            "mini-batch takes whole groups"
        )
    if algorithm.rollout_lag >= cfg.train.steps:
        raise ValueError(
            f"algorithm.rollout_lag ({algorithm.rollout_lag}) must be smaller than train.steps "
            f"({cfg.train.steps}): the first {algorithm.rollout_lag} rollout steps only generate, "
            "so no optimizer step would run"
        )
    if rollout.partial_tokens_per_round is not None and (
        algorithm.rollout_lag or algorithm.replay_fraction
    ):
        raise ValueError(
            "rollout.partial_tokens_per_round cannot be combined with "
            "algorithm.rollout_lag or algorithm.replay_fraction in one run"
        )
