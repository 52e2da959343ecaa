"""How a mixture-of-experts policy routes, measured against the engine's routes (every
``logging.logprob_diff_interval`` rollout steps, whatever ``algorithm.routing_replay`` says).

One extra forward pass of the actor with live routing over each mini-batch whose samples carry
the engine's routes gives:

- ``moe/router_disagreement``: share of the tokens the engine routed (prompt and response,
  every MoE layer considered) whose top-k expert set differs in some layer between engine and
  actor; the disagreement routing replay removes;
- ``moe/logprob_gap_live``: mean |actor - engine| log-prob of the response tokens sampled with
  the current weights, with the actor routing live (``logprob_diff/*`` is the gap of the pass
  that computes old log-probs, which replays the engine's routes under `rollout`);
- ``moe/expert_load_max_over_mean``: over MoE layers and experts, the most tokens an expert
  received over the mean (1: perfectly even), from the actor's live routing.
"""

from __future__ import annotations

import dataclasses

import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.actor.logprobs import compute_logprobs_and_routes
from bapo_megatron.actor.microbatches import Batching
from bapo_megatron.distributed.collectives import max_over, sum_over
from bapo_megatron.distributed.context import ParallelContext


def expert_sets(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., layers, topk] expert ids (-1: none) as [..., layers, experts] bool sets."""
    chosen = torch.zeros(*routes.shape[:-1], num_experts + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(routes < 0, num_experts, routes), True)
    return chosen[..., :num_experts]


@dataclasses.dataclass
class RouterAgreement:
    """One replica's sums over the mini-batches of a rollout step."""

    num_experts: int
    differing: float = 0.0
    routed_tokens: float = 0.0
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    load: torch.Tensor | None = None
    """[moe_layers, experts] tokens each expert received (live routing)."""

    def add(self, actor, batch: PolicyBatch, current: torch.Tensor, *, temperature: float) -> None:
        """Measure ``batch`` (carrying the engine's routes; ``current``: response tokens sampled
        with the actor's current weights). Collective over the model replica's ranks."""
        if batch.routes is None:
            return
        live_logprobs, live_routes = compute_logprobs_and_routes(
            actor.chunks,
            dataclasses.replace(batch, routes=None),
            actor.context,
            actor.routing_replay,
            batching=Batching.for_logprobs(actor.actor_config),
            fp8_multiple=actor.fp8_length_multiple,
            temperature=temperature,
        )
        engine = batch.routes
        routed = (engine >= 0).all(-1).all(-1)  # [n, s] tokens the engine ran
        differs = (
            (expert_sets(engine, self.num_experts) != expert_sets(live_routes, self.num_experts))
            .any(-1)
            .any(-1)
        )
        self.differing += float((differs & routed).sum())
        self.routed_tokens += float(routed.sum())
        same_policy = batch.response_mask & current
        self.gap_sum += float((live_logprobs - batch.old_logprobs)[same_policy].abs().sum())
        self.gap_tokens += float(same_policy.sum())
        sets = expert_sets(live_routes, self.num_experts) & routed[..., None, None]
        load = sets.sum(dim=(0, 1)).double()  # [layers, experts]
        self.load = load if self.load is None else self.load + load

    def metrics(self, context: ParallelContext) -> dict[str, float]:
        """The step's metrics over every data-parallel replica (collective over them; every
        replica calls it, also one without a measured mini-batch)."""
        layers = 0 if self.load is None else self.load.shape[0]
        # a replica without a measured mini-batch still joins the sum, with zeros
        layers = int(max_over([float(layers)], context.dp_group, context.device)[0])
        load = self.load if self.load is not None else torch.zeros(layers, self.num_experts)
        sums = sum_over(
            [self.differing, self.routed_tokens, self.gap_sum, self.gap_tokens]
            + load.flatten().tolist(),
            context.dp_group,
            context.device,
        )
        differing, routed, gap, gap_tokens = sums[:4]
        if routed == 0:
            return {}
        per_expert = torch.tensor(sums[4:], dtype=torch.float64).view(layers, self.num_experts)
        mean = per_expert.mean(-1).clamp(min=1e-12)
        return {
            "moe/router_disagreement": differing / routed,
            "moe/logprob_gap_live": gap / max(gap_tokens, 1.0),
            "moe/expert_load_max_over_mean": float((per_expert.max(-1).values / mean).max()),
        }
