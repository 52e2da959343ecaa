"""What the actor's layout tests share (tests/distributed/test_train_layouts.py and
test_moe_train_layouts.py): a batch of off-policy sequences, an actor trained a few steps from
given weights, how far a rank's shards end from the one-process run's, and the metric
comparison."""

from __future__ import annotations

import pytest
import torch

from bapo_megatron.actor.actor import build_actor
from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.model import (
    global_parameter_name,
    load_whole_model_weights,
    parameter_shard,
)
from bapo_megatron.actor.train_step import train_step
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.config import (
    ActorConfig,
    ClipSearchConfig,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
)
from bapo_megatron.distributed.context import ParallelContext

OPTIMIZER = OptimizerConfig(lr=3e-3, weight_decay=0.01, clip_grad=0.5)
LOSS = LossConfig(aggregation="token-mean")
STEPS = 3
NUM_SEQUENCES = 8
COMPARED = (
    "loss",
    "grad_norm",
    "entropy",
    "bapo/c_low",
    "bapo/c_high",
    "bapo/rho_before",
    "bapo/rho_after",
    "bapo/search_steps",
    "response_tokens",
)
"""The per-step metrics every layout must reproduce."""
# Adam turns float rounding in near-zero gradient components into differences of the size of
# an update; 1% of the most a parameter can move in STEPS steps (about lr per step).
PARAM_TOLERANCE = 0.01 * OPTIMIZER.lr * STEPS
LAUNCH_TIMEOUT_S = 600.0


def plan(granularity: str = "step") -> SearchPlan:
    return SearchPlan.from_config(ClipSearchConfig.from_preset("paper", granularity=granularity))


def sequences(
    initial_logprobs_of, vocab_size: int, seed: int, advantage_shift: float = 0.0
) -> PolicyBatch:
    """NUM_SEQUENCES right-padded sequences of lengths 9-16 with 3-6 prompt tokens; old log-probs
    are the initial policy's plus noise; one advantage per sequence (shifted by
    ``advantage_shift``)."""
    g = torch.Generator().manual_seed(seed)
    length = 16
    tokens = torch.randint(0, vocab_size, (NUM_SEQUENCES, length), generator=g)
    mask = torch.zeros(NUM_SEQUENCES, length, dtype=torch.bool)
    for i in range(NUM_SEQUENCES):
        prompt = int(torch.randint(3, 7, (), generator=g))
        end = int(torch.randint(9, length + 1, (), generator=g))
        mask[i, prompt:end] = True
        tokens[i, end:] = 0
    logprobs = initial_logprobs_of(PolicyBatch(tokens=tokens, response_mask=mask))
    old = torch.where(mask, logprobs + 0.4 * torch.randn(NUM_SEQUENCES, length, generator=g), 0.0)
    advantages = torch.randn(NUM_SEQUENCES, generator=g) + advantage_shift
    return PolicyBatch(tokens=tokens, response_mask=mask, old_logprobs=old, advantages=advantages)


def whole_weights(actor) -> dict[str, torch.Tensor]:
    """Copies of a one-process actor's parameters by global name."""
    return {
        global_parameter_name(c, n): p.detach().clone()
        for c in actor.chunks
        for n, p in c.module.named_parameters()
    }


def train(
    model: ModelConfig,
    actor_config: ActorConfig,
    context: ParallelContext,
    weights: dict[str, torch.Tensor],
    batch: PolicyBatch,
    granularity: str = "step",
    optimizer: OptimizerConfig = OPTIMIZER,
) -> dict:
    """Build an actor with ``weights``, train STEPS steps on ``batch``: metrics per step and the
    final parameters by global name (this rank's shards, as (local name, parameter))."""
    actor = build_actor(model, actor_config, optimizer, context)
    load_whole_model_weights(actor.chunks, weights, context)
    step_plan = plan(granularity)
    metrics = [train_step(actor, batch, LOSS, step_plan) for _ in range(STEPS)]
    params = {}
    for chunk in actor.chunks:
        for name, param in chunk.module.named_parameters():
            params[global_parameter_name(chunk, name)] = (name, param)  # keeps its TP attributes
    return dict(metrics=metrics, params=params)


def final_weights(run: dict) -> dict[str, torch.Tensor]:
    """Copies of a :func:`train` run's final parameters by global name."""
    return {name: p.detach().clone() for name, (_, p) in run["params"].items()}


def param_error(params: dict, final: dict[str, torch.Tensor], context: ParallelContext) -> float:
    """Largest absolute difference between this rank's shards and the reference's final weights
    (a tied output layer is compared with the embedding)."""
    worst = 0.0
    for global_name, (local_name, shard) in params.items():
        name = global_name if global_name in final else "embedding.word_embeddings.weight"
        expected = parameter_shard(local_name, final[name], shard, context)
        worst = max(worst, float((shard.detach() - expected).abs().max()))
    return worst


def run_result(run: dict, final: dict[str, torch.Tensor], context: ParallelContext) -> dict:
    """What a worker reports of one :func:`train` run: its metrics and its parameter error."""
    return dict(metrics=run["metrics"], param_error=param_error(run["params"], final, context))


def assert_metrics_match(
    got: list[dict], want: list[dict], what: str, compared: tuple[str, ...] = COMPARED
) -> None:
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        for key in compared:
            assert g[key] == pytest.approx(w[key], rel=2e-5, abs=2e-6), f"{what} step {step} {key}"
        assert g["skipped"] == 0.0
