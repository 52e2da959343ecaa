"""One optimizer step of the actor on this data-parallel rank's share of the step's sequences.

Order of events, the same on every rank (collectives must line up):

0. Under a token budget (``actor.max_tokens_per_microbatch``), the step's sequences are first
   balanced over the data-parallel ranks by their cost
   (:mod:`bapo_megatron.actor.data_balance`); each rank then splits its own into micro-batches,
   padded rows or packed ones (:mod:`bapo_megatron.actor.microbatches`).
1. One all-gather over data x context parallel: each rank's micro-batch count, response tokens,
   responding sequences and longest row. Every rank then runs the largest count (padding with
   empty micro-batches), knows the step's global loss normalizer, and, where expert parallelism
   needs it, gives every row one length.
2. Granularity `step` with a search: a no-grad forward pass over the step's micro-batches gives
   the search statistics; summed locally, reduced once over data x context parallel on the last
   stage, they fix the bounds for the whole step. Granularity `microbatch` (or fixed clips):
   each micro-batch's loss searches on its own statistics, reduced over the same group.
   The extra forward pass of granularity `step` is skipped where it would tell nothing new:
   when the step has one micro-batch (its loss sees the whole step's statistics, so searching
   there decides the same bounds from the same numbers), and when the caller knows every ratio
   is 1 (``ratios_are_one``: old log-probs recomputed with the current weights, so the
   statistics follow from them without a forward pass).
3. Forward/backward through Megatron's schedule, the BAPO loss on the last stage.
4. Optimizer step (skipped when the gradient norm is not finite).
5. Metrics for the whole step, reduced over data x context parallel on the last stage and
   broadcast to the other pipeline stages.

A batch that carries routes (``PolicyBatch.routes``) has them replayed by the routers in
steps 2 and 3 (:mod:`bapo_megatron.actor.routing_replay`). A mixture-of-experts actor adds its
load-balancing term in step 3 (the routers' hooks,
:mod:`bapo_megatron.actor.moe_aux_loss`), weighted by the step's real tokens, which the
all-gather of step 1 also counts; the term's value joins the metrics.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from bapo_megatron.actor.actor import Actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.data_balance import balance_data_parallel
from bapo_megatron.actor.logprobs import token_logprobs
from bapo_megatron.actor.microbatches import (
    Batching,
    Groups,
    agreed_row_length,
    build_microbatches,
    length_multiples,
    padding_share,
    plan_groups,
)
from bapo_megatron.actor.optimizer import optimizer_step
from bapo_megatron.actor.pipeline_schedule import last_stage_rank, run_schedule
from bapo_megatron.actor.response_logits import StageLogits
from bapo_megatron.actor.routing_replay import validate_routes
from bapo_megatron.algo.bound_search import BoundDecision, choose_bounds
from bapo_megatron.algo.kl import kl_loss_term
from bapo_megatron.algo.policy_loss import bapo_loss, loss_normalizer, search_statistics
from bapo_megatron.algo.reduction import all_reduce_sum
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import LossConfig
from bapo_megatron.config.kl import KLConfig

# Decision metrics that are counts: summed over micro-batches; the others are token-weighted means.
_COUNT_METRICS = ("bapo/tokens", "bapo/positive_tokens", "bapo/negative_tokens")
# Terms of the loss besides the policy loss, each micro-batch's part: summed like the loss.
_BONUS_METRICS = ("actor/entropy_bonus",)


def train_step(
    actor: Actor,
    batch: PolicyBatch,
    loss: LossConfig,
    plan: SearchPlan,
    *,
    ratios_are_one: bool = False,
    skip_known_forward: bool = True,
    kl: KLConfig | None = None,
) -> dict[str, float]:
    """Train on ``batch`` (this data-parallel rank's sequences; ranks may hold different numbers,
    including none) for one optimizer step and return the step's metrics, the same on every
    rank: `loss`, `entropy` (mean over response tokens), `response_tokens`, `grad_norm`, `lr`,
    `skipped` (1 when the update was dropped for a non-finite gradient norm),
    `skipped_steps` (so far), `num_microbatches`, `actor/padding_share` (share of the
    positions computed that were padding), `actor/over_budget_sequences` (sequences longer than
    the token budget, each run alone), and the `bapo/*` search metrics; with an entropy bonus
    (``loss.entropy_coef``), `actor/entropy_bonus` (subtracted from `loss`) and
    `actor/policy_loss` (`loss` without it). A
    mixture-of-experts actor adds `moe/aux_loss` (the term added to the loss, coefficient
    included) and `moe/load_balancing_loss` (its value per MoE layer without the coefficient:
    1 when the routers spread tokens evenly).

    ``ratios_are_one``: ``batch.old_logprobs`` are this actor's log-probs under its current
    weights (recomputed since its last optimizer step, the same on every rank), so every ratio
    is exactly 1. ``skip_known_forward=False`` runs granularity `step`'s extra forward pass
    even where its result is known (module docstring, step 2), for tests and benchmarks.

    ``kl`` (``algorithm.kl``), with a batch that carries ``ref_logprobs``: `kl/mean` (the
    estimator at the policy being trained, mean over response tokens) joins the metrics and,
    under placement `loss`, beta times the aggregated estimator joins the loss (`kl/loss`; the
    `loss` metric includes it). The term is not in the search's statistics."""
    batch.require_training_fields()
    context = actor.context
    batching = Batching.for_training(actor.actor_config)
    if batching.max_tokens is not None and context.dp_size > 1:
        batch = balance_data_parallel(batch, context, actor.model_config.hidden_size)
    multiples = length_multiples(context, actor.fp8_length_multiple)
    groups = plan_groups(batch, batching, multiples)
    agreed = _agree_on_step(batch, groups, context)
    count, tokens, sequences, real_tokens, over_budget, longest = agreed
    if context.vpp_size is not None:  # the interleaved schedule wants whole groups of PP
        count = -(-max(count, context.pp_size) // context.pp_size) * context.pp_size
    microbatches = build_microbatches(
        batch, groups, batching, multiples, count, agreed_row_length(groups, context, longest)
    )
    normalizer = tokens if loss.aggregation == "token-mean" else sequences
    reduce = all_reduce_sum(context.dp_cp_group)
    temperature = actor.actor_config.temperature

    with_kl = kl is not None and batch.ref_logprobs is not None
    replay = _routing_replay(actor, batch)
    before_forward = _before_forward(actor.moe_aux_loss, replay)

    decision, extremes = None, None
    if plan.config.granularity == "step" and not plan.is_fixed:
        if skip_known_forward and ratios_are_one and context.cp_size == 1:
            decision, extremes = _decide_at_ratio_one(microbatches, plan, reduce, context)
        elif not skip_known_forward or count > 1:
            with replay.replaying() if replay is not None else contextlib.nullcontext():
                decision, extremes = _decide_for_step(
                    actor, microbatches, plan, reduce, before_forward
                )
        # else one micro-batch: its loss searches on the step's statistics (decision None)

    def per_microbatch(microbatch: PolicyBatch, logits: StageLogits):
        logprobs, entropy = token_logprobs(
            logits, microbatch.tokens, context, temperature=temperature, with_entropy=True
        )
        segments = microbatch.segments
        mask = microbatch.response_mask.to(logprobs.device)
        value, metrics = bapo_loss(
            logprobs,
            microbatch.old_logprobs.to(logprobs.device),
            microbatch.advantages.to(logprobs.device),
            mask,
            plan=plan,
            normalizer=normalizer,
            aggregation=loss.aggregation,
            reduce=reduce,
            is_weights=None
            if microbatch.is_weights is None
            else microbatch.is_weights.to(logprobs.device),
            decision=decision,
            sequence_ids=None if segments is None else segments.sequence_ids(),
            entropy=entropy if loss.entropy_coef else None,
            entropy_coef=loss.entropy_coef,
        )
        metrics["entropy_sum"] = torch.where(mask, entropy.detach(), 0.0).sum().double()
        if with_kl:
            term, metrics["kl_sum"] = kl_loss_term(
                logprobs,
                microbatch.ref_logprobs.to(logprobs.device),
                mask,
                coef=kl.coef if kl.placement == "loss" else 0.0,
                estimator=kl.estimator,
                aggregation=loss.aggregation,
                normalizer=normalizer,
                sequence_ids=None if segments is None else segments.sequence_ids(),
            )
            metrics["kl_loss"] = term.detach().double()
            if kl.placement == "loss" and kl.coef:  # added after the search, outside P and N
                value = value + term
        metrics["loss"] = value.detach().double()
        return value, metrics

    for chunk in actor.chunks:
        chunk.zero_grad_buffer()
    actor.optimizer.zero_grad()
    aux = actor.moe_aux_loss
    with contextlib.ExitStack() as passes:
        if aux is not None:
            passes.enter_context(aux.training_step(real_tokens))
        if replay is not None:
            passes.enter_context(replay.replaying())
        outputs = run_schedule(
            actor.chunks,
            microbatches,
            per_microbatch,
            context,
            forward_only=False,
            before_forward=before_forward,
        )
    outcome = optimizer_step(actor.optimizer, actor.scheduler, actor.optimizer_config.clip_grad)
    if outcome.skipped:
        actor.skipped_steps += 1

    metrics = {}
    if context.is_last_stage():
        metrics = _step_metrics(outputs, decision, extremes, padding_share(microbatches), context)
        metrics["response_tokens"] = tokens
        if with_kl:
            metrics["kl/mean"] = metrics.pop("kl_sum") / max(tokens, 1.0)
            metrics["kl/loss"] = metrics.pop("kl_loss")
    metrics = _from_last_stage(metrics, context)
    if aux is not None:
        value = aux.step_value()
        metrics["moe/aux_loss"] = aux.coef * value
        metrics["moe/load_balancing_loss"] = value / actor.model_config.moe.num_moe_layers(
            actor.model_config.num_layers
        )
    metrics.update(
        grad_norm=outcome.grad_norm,
        lr=outcome.lr,
        skipped=float(outcome.skipped),
        skipped_steps=float(actor.skipped_steps),
        num_microbatches=float(count),
    )
    metrics["actor/over_budget_sequences"] = over_budget
    return metrics


def _routing_replay(actor: Actor, batch: PolicyBatch):
    """The actor's routing replay when ``batch`` carries routes (checked first), else None."""
    if batch.routes is None:
        return None
    if actor.routing_replay is None:
        raise ValueError(
            f"batch.routes: model.model_type {actor.model_config.model_type!r} has no experts "
            "to replay routes on"
        )
    validate_routes(batch.routes, actor.model_config, "batch.routes")
    return actor.routing_replay


def _before_forward(aux, replay):
    """What runs before each chunk's forward of a micro-batch: the aux term's token flags and
    the routes to replay (None for a dense model)."""
    hooks = [hook.before_forward for hook in (aux, replay) if hook is not None]
    if not hooks:
        return None

    def before_forward(microbatch: PolicyBatch, chunk: torch.nn.Module) -> None:
        for hook in hooks:
            hook(microbatch, chunk)

    return before_forward


def _agree_on_step(
    batch: PolicyBatch, groups: Groups, context
) -> tuple[int, float, float, float, float, int]:
    """(largest micro-batch count, global response tokens, global responding sequences, global
    real tokens: every position up to each sequence's last response token, global sequences
    over the token budget, longest row) over the data x context parallel group, in one
    collective."""
    mask = batch.response_mask
    positions = torch.arange(mask.shape[1])
    real = (torch.where(mask, positions, -1).amax(dim=1) + 1).sum() if mask.numel() else 0
    local = torch.tensor(
        [
            float(groups.count),
            float(loss_normalizer(mask, "token-mean")),
            float(loss_normalizer(mask, "seq-mean-token-sum")),
            float(real),
            float(groups.over_budget),
            float(groups.row_length),
        ],
        dtype=torch.float64,
        device=context.device,
    )
    if context.dp_cp_size == 1:
        gathered = local[None]
    else:
        parts = [torch.empty_like(local) for _ in range(context.dp_cp_size)]
        dist.all_gather(parts, local, group=context.dp_cp_group)
        gathered = torch.stack(parts)
    count = int(gathered[:, 0].max())
    if count == 0:
        raise ValueError("train_step: no data-parallel rank has any sequence for this step")
    return (
        count,
        float(gathered[:, 1].sum()),
        float(gathered[:, 2].sum()),
        float(gathered[:, 3].sum()),
        float(gathered[:, 4].sum()),
        int(gathered[:, 5].max()),
    )


def _decide_for_step(
    actor: Actor, microbatches: list[PolicyBatch], plan: SearchPlan, reduce, before_forward
) -> tuple[BoundDecision | None, torch.Tensor | None]:
    """Granularity `step`: search statistics of every micro-batch from a no-grad forward pass,
    reduced once, then the bounds. Last stage only (elsewhere: None, None)."""
    context = actor.context
    temperature = actor.actor_config.temperature

    def per_microbatch(microbatch: PolicyBatch, logits: StageLogits):
        logprobs, _ = token_logprobs(
            logits, microbatch.tokens, context, temperature=temperature, with_entropy=False
        )
        device = logprobs.device
        stats, extremes = search_statistics(
            logprobs,
            microbatch.old_logprobs.to(device),
            microbatch.advantages.to(device),
            microbatch.response_mask.to(device),
            plan=plan,
            is_weights=None if microbatch.is_weights is None else microbatch.is_weights.to(device),
        )
        return logprobs.sum(), {"stats": stats, "extremes": extremes}

    with torch.no_grad():
        outputs = run_schedule(
            actor.chunks,
            microbatches,
            per_microbatch,
            context,
            forward_only=True,
            before_forward=before_forward,
        )
    if not context.is_last_stage():
        return None, None
    stats = torch.stack([out["stats"] for out in outputs]).sum(0)
    extremes = torch.stack([out["extremes"] for out in outputs])
    extremes = torch.stack([extremes[:, 0].min(), extremes[:, 1].max()])
    return choose_bounds(reduce(stats), plan), extremes


def _decide_at_ratio_one(
    microbatches: list[PolicyBatch], plan: SearchPlan, reduce, context
) -> tuple[BoundDecision | None, torch.Tensor | None]:
    """Granularity `step` when every ratio is 1: the statistics of the old log-probs against
    themselves (r = exp(0) = 1 exactly, what the forward pass would give), reduced once, then
    the bounds. Last stage only (elsewhere: None, None), as :func:`_decide_for_step`."""
    if not context.is_last_stage():
        return None, None
    parts = [
        search_statistics(
            mb.old_logprobs.to(context.device),
            mb.old_logprobs.to(context.device),
            mb.advantages.to(context.device),
            mb.response_mask.to(context.device),
            plan=plan,
            is_weights=None if mb.is_weights is None else mb.is_weights.to(context.device),
        )
        for mb in microbatches
    ]
    stats = torch.stack([part[0] for part in parts]).sum(0)
    extremes = torch.stack([part[1] for part in parts])
    extremes = torch.stack([extremes[:, 0].min(), extremes[:, 1].max()])
    return choose_bounds(reduce(stats), plan), extremes


def _step_metrics(
    outputs: list[dict[str, torch.Tensor]],
    decision: BoundDecision | None,
    extremes: torch.Tensor | None,
    padding: tuple[int, int],
    context,
) -> dict[str, float]:
    """The step's metrics on a last-stage rank, reduced over data x context parallel."""
    if decision is not None:  # one decision for the whole step: its metrics are the step's
        search = {key: value.double() for key, value in decision.metrics.items()}
    else:  # one decision per micro-batch (each already global): combine them
        search = _combine_microbatch_decisions(outputs)
        extremes = torch.stack(
            [
                torch.stack([out["bapo/ratio_min_local"] for out in outputs]).min(),
                torch.stack([out["bapo/ratio_max_local"] for out in outputs]).max(),
            ]
        )
    device = outputs[0]["loss"].device
    extra = [key for key in (*_BONUS_METRICS, "kl_sum", "kl_loss") if key in outputs[0]]
    summed = ["loss", "entropy_sum", *extra]
    sums = torch.stack(
        [
            *(torch.stack([out[key] for out in outputs]).sum() for key in summed),
            torch.tensor(float(padding[0]), dtype=torch.float64, device=device),
            torch.tensor(float(padding[1]), dtype=torch.float64, device=device),
        ]
    )
    extremes = torch.stack([-extremes[0], extremes[1]]).double()  # both reduced with MAX
    if context.dp_cp_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=context.dp_cp_group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=context.dp_cp_group)
    tokens = search["bapo/tokens"]
    metrics = {key: float(value) for key, value in search.items()}
    metrics.update(
        loss=float(sums[0]),
        entropy=float(sums[1] / tokens.clamp(min=1)),
        **{"actor/padding_share": float(sums[-1] / sums[-2].clamp(min=1))},
        **{"bapo/ratio_min": float(-extremes[0]), "bapo/ratio_max": float(extremes[1])},
    )
    for index, key in enumerate(summed[2:], start=2):
        metrics[key] = float(sums[index])
    if "actor/entropy_bonus" in metrics:  # the loss: policy loss - entropy bonus + KL term
        metrics["actor/policy_loss"] = (
            metrics["loss"] + metrics["actor/entropy_bonus"] - metrics.get("kl_loss", 0.0)
        )
    return metrics


def _combine_microbatch_decisions(
    outputs: list[dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    keys = [key for key in outputs[0] if key.startswith("bapo/") and not key.endswith("_local")]
    if len(outputs) == 1:  # one decision: its metrics as they are (no x * w / w rounding)
        return {key: outputs[0][key].double() for key in keys}
    weights = torch.stack([out["bapo/tokens"].double() for out in outputs])
    total = weights.sum()
    combined = {}
    for key in keys:
        values = torch.stack([out[key].double() for out in outputs])
        if key in _COUNT_METRICS:
            combined[key] = values.sum()
        else:  # token-weighted; micro-batches without tokens anywhere carry no weight
            combined[key] = (values * weights).sum() / total if total > 0 else values.mean()
    return combined


def _from_last_stage(metrics: dict[str, float], context) -> dict[str, float]:
    if context.pp_size == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(box, src=last_stage_rank(context), group=context.pp_group)
    return dict(box[0])
