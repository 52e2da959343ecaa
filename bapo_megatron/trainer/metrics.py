"""The training loop's per-step metrics, summed (or maximized) over data-parallel replicas.

Each replica sees only its share of the step's groups, so every statistic is first gathered as
sums and counts on each replica (:class:`RolloutCounts`, :class:`LogprobGap`), reduced over the
data-parallel group with :mod:`bapo_megatron.distributed.collectives`, and only then turned into
means: every rank logs the same numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from bapo_megatron.algo.importance_weights import WeightStatistics
from bapo_megatron.distributed.collectives import max_over, sum_over, union_over
from bapo_megatron.distributed.context import ParallelContext


@dataclass
class RolloutCounts:
    """Sums over one replica's finished samples of a rollout step."""

    samples: float = 0.0
    reward: float = 0.0
    correct: float = 0.0
    length: float = 0.0
    length_right: float = 0.0
    right: float = 0.0
    length_wrong: float = 0.0
    wrong: float = 0.0
    truncated: float = 0.0
    truncated_wrong: float = 0.0
    groups: float = 0.0
    informative_groups: float = 0.0
    reward_timeouts: float = 0.0
    reward_errors: float = 0.0
    generated_tokens: float = 0.0
    overlong_penalty: float = 0.0
    """Sum of the overlong penalties added to the rewards (<= 0)."""
    overlong_penalized: float = 0.0
    """Samples whose reward the overlong penalty lowered."""
    overlong_filtered: float = 0.0
    """Samples left out of training because they were cut off at the length cap."""
    # asynchronous training only
    dropped_groups: float = 0.0
    mixed_version_samples: float = 0.0
    engine_idle_s: float = 0.0
    engine_generate_s: float = 0.0
    engine_load_s: float = 0.0
    engine_loads: float = 0.0
    trainer_wait_s: float = 0.0
    queued_items: float = 0.0
    # dynamic sampling with refill only
    refill_rounds: float = 0.0
    short_groups: float = 0.0
    surplus_groups: float = 0.0
    reward_metrics: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """The metrics the reward's checks returned beside their scores (a dict result's other
    numbers): name -> (sum, checks that returned it)."""

    def add_reward_metrics(self, returned: list[dict[str, float]]) -> None:
        """Add each check's returned metrics (:attr:`ScoredBatch.metrics
        <bapo_megatron.rewards.pool.ScoredBatch.metrics>`)."""
        for metrics in returned:
            for name, value in metrics.items():
                total, count = self.reward_metrics.get(name, (0.0, 0.0))
                self.reward_metrics[name] = (total + value, count + 1.0)


_SUMMED = [f.name for f in dataclasses.fields(RolloutCounts) if isinstance(f.default, float)]
"""The :class:`RolloutCounts` fields that are plain sums."""
_REWARD_METRICS = ("mean", "accuracy", "timeouts", "errors")
"""The trainer's own ``reward/*`` metrics; a reward's metric of one of these names is logged as
``reward/returned_<name>``."""


def rollout_metrics(
    counts: RolloutCounts,
    context: ParallelContext,
    *,
    asynchronous: bool = False,
    overlong: bool = False,
    refill: bool = False,
) -> dict[str, float]:
    """Reward, accuracy, lengths and rollout counts of the step, over every replica (with
    ``asynchronous``, also the engines' and the trainer's waits, in-flight updates and drops;
    with ``overlong``, what the overlong penalty and filter did; with ``refill``, dynamic
    sampling's rounds and shortfall), and the reward's own metrics:
    ``reward/<name>``, the mean over the checks that returned it."""
    names = _SUMMED
    totals = dict(
        zip(
            names,
            sum_over([getattr(counts, name) for name in names], context.dp_group, context.device),
        )
    )
    samples = max(totals["samples"], 1.0)
    metrics = {
        "reward/mean": totals["reward"] / samples,
        "reward/accuracy": totals["correct"] / samples,
        "response_length/mean": totals["length"] / samples,
        "response_length/right": totals["length_right"] / max(totals["right"], 1.0),
        "response_length/wrong": totals["length_wrong"] / max(totals["wrong"], 1.0),
        "rollout/truncated_fraction": totals["truncated"] / samples,
        # how many failures run to the length cap (the premise of BAPO: failures run long)
        "rollout/wrong_truncated_fraction": totals["truncated_wrong"] / max(totals["wrong"], 1.0),
        "rollout/finished_groups": totals["groups"],
        "rollout/informative_groups": totals["informative_groups"],
        "rollout/generated_tokens": totals["generated_tokens"],
        "reward/timeouts": totals["reward_timeouts"],
        "reward/errors": totals["reward_errors"],
    }
    if overlong:
        metrics["overlong/penalty_mean"] = totals["overlong_penalty"] / samples
        metrics["overlong/penalized_fraction"] = totals["overlong_penalized"] / samples
        metrics["overlong/filtered_fraction"] = totals["overlong_filtered"] / samples
    metrics.update(_reward_metrics(counts, context))
    if asynchronous:
        metrics.update(_asynchronous_metrics(totals, context.dp_size))
    if refill:
        metrics.update(
            {
                "dynamic_sampling/refill_rounds": totals["refill_rounds"] / context.dp_size,
                "dynamic_sampling/short_groups": totals["short_groups"],
                "dynamic_sampling/surplus_groups": totals["surplus_groups"],
            }
        )
    return metrics


def _reward_metrics(counts: RolloutCounts, context: ParallelContext) -> dict[str, float]:
    """``reward/<name>`` of every metric a check returned on some replica: its mean over the
    checks of every replica that returned it."""
    names = union_over(sorted(counts.reward_metrics), context.dp_group)
    if not names:
        return {}
    pairs = [counts.reward_metrics.get(name, (0.0, 0.0)) for name in names]
    sums = sum_over([x for pair in pairs for x in pair], context.dp_group, context.device)
    out = {}
    for i, name in enumerate(names):
        total, count = sums[2 * i], sums[2 * i + 1]
        label = f"returned_{name}" if name in _REWARD_METRICS else name
        out[f"reward/{label}"] = total / count
    return out


def _asynchronous_metrics(totals: dict[str, float], replicas: int) -> dict[str, float]:
    engine_s = totals["engine_idle_s"] + totals["engine_generate_s"]
    return {
        "async/dropped_groups": totals["dropped_groups"],
        "async/mixed_version_samples": totals["mixed_version_samples"],
        "async/queued_items": totals["queued_items"] / replicas,
        "async/trainer_wait_s": totals["trainer_wait_s"] / replicas,
        "async/engine_idle_s": totals["engine_idle_s"] / replicas,
        "async/engine_idle_share": totals["engine_idle_s"] / engine_s if engine_s else 0.0,
        "async/engine_generate_s": totals["engine_generate_s"] / replicas,
        "async/engine_tokens_per_s": (
            totals["generated_tokens"] / totals["engine_generate_s"]
            if totals["engine_generate_s"]
            else 0.0
        ),
        "async/engine_weight_loads": totals["engine_loads"],
        "async/engine_weight_load_s": totals["engine_load_s"] / replicas,
    }


WEIGHT_FIELDS = tuple(f.name for f in dataclasses.fields(WeightStatistics))
"""The importance-weight sums :class:`LogprobGap` adds up."""


@dataclass
class LogprobGap:
    """One replica's engine/actor log-prob gap and off-policy correction weights of a step,
    accumulated over the mini-batches whose old log-probs were recomputed."""

    gap_sum: float = 0.0
    """Sum of |actor - engine| log-prob over the tokens sampled with the current weights."""
    gap_max: float = 0.0
    gap_tokens: float = 0.0
    correction: str | None = None
    """The off-policy correction whose weights were added (None: no weight)."""
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    """Sums of the :class:`WeightStatistics` fields over the mini-batches."""

    def add_gap(self, gap: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add the gaps ``gap`` of the ``tokens`` (a mask) sampled with the current weights."""
        self.gap_sum += float(gap.abs().sum())
        self.gap_max = max(self.gap_max, float(gap.abs().max()) if gap.numel() else 0.0)
        self.gap_tokens += float(tokens.sum())

    def add_weights(self, correction: str, statistics: WeightStatistics) -> None:
        """Add one mini-batch's importance-weight ``statistics`` under ``correction``."""
        self.correction = correction
        for name in WEIGHT_FIELDS:
            self.weights[name] = self.weights.get(name, 0.0) + float(getattr(statistics, name))

    def metrics(self, context: ParallelContext) -> dict[str, float]:
        """The gap (and importance-weight) metrics over every replica."""
        group, device = context.dp_group, context.device
        total, tokens = sum_over([self.gap_sum, self.gap_tokens], group, device)
        (largest,) = max_over([self.gap_max], group, device)
        out = {}
        if self.correction is not None:
            sums = dict(
                zip(
                    WEIGHT_FIELDS,
                    sum_over([self.weights[name] for name in WEIGHT_FIELDS], group, device),
                )
            )
            count = max(sums["tokens"], 1.0)
            if self.correction == "token-truncate":  # the names this correction always had
                out["is_weights/mean"] = sums["weight_sum"] / count
                out["is_weights/capped_fraction"] = sums["clipped_tokens"] / count
            out["off_policy/weight_mean"] = sums["weight_sum"] / count
            out["off_policy/clipped_token_share"] = sums["clipped_tokens"] / count
            out["off_policy/clipped_sequence_share"] = sums["clipped_sequences"] / max(
                sums["sequences"], 1.0
            )
            out["off_policy/masked_token_share"] = sums["masked_tokens"] / count
            out["off_policy/masked_sequences"] = sums["masked_sequences"]
            out["off_policy/sequences"] = sums["sequences"]
        out["logprob_diff/tokens"] = tokens
        if tokens:
            out["logprob_diff/mean_abs"] = total / tokens
            out["logprob_diff/max_abs"] = largest
        return out


def staleness(
    versions: torch.Tensor,
    version: int,
    context: ParallelContext,
    *,
    histogram_bins: int = 0,
) -> dict[str, float]:
    """Policy versions between each response token's sampling and the update it trains; with
    ``histogram_bins`` = k, also the share of tokens 0, 1, ..., k - 1 versions behind
    (``staleness/share_<i>``) and at least k behind (``staleness/share_<k>+``)."""
    behind = (version - versions[versions >= 0]).double()
    bins = [float((behind == i).sum()) for i in range(histogram_bins)]
    if histogram_bins:
        bins.append(float((behind >= histogram_bins).sum()))
    total, count, *counts = sum_over(
        [float(behind.sum()), float(behind.numel()), *bins], context.dp_group, context.device
    )
    (largest,) = max_over(
        [float(behind.max()) if behind.numel() else 0.0], context.dp_group, context.device
    )
    out = {"staleness/mean": total / max(count, 1.0), "staleness/max": largest}
    for i, tokens in enumerate(counts):
        label = f"{i}+" if i == histogram_bins else str(i)
        out[f"staleness/share_{label}"] = tokens / max(count, 1.0)
    return out


def throughput(metrics: dict[str, float], trained_tokens: float) -> dict[str, float]:
    """Tokens per second of the rollout step: generated per rollout second, trained (response
    tokens of every update, epochs counted) per train second, and generated per step second."""
    out = {}
    if metrics.get("time/rollout"):
        out["throughput/rollout_tokens_per_s"] = (
            metrics["rollout/generated_tokens"] / metrics["time/rollout"]
        )
    if trained_tokens and metrics.get("time/train"):
        out["throughput/train_tokens_per_s"] = trained_tokens / metrics["time/train"]
    if metrics.get("time/step"):
        out["throughput/tokens_per_s"] = metrics["rollout/generated_tokens"] / metrics["time/step"]
    return out
