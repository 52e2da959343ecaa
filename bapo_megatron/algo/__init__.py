"""The mathematics of BAPO, torch only: importance ratios, the clipped surrogate, its aggregation,
and the adaptive clip-bound search. No Megatron, no process groups: collectives come in through
a ``reduce`` callable."""

from bapo_megatron.algo.bound_search import BoundDecision, choose_bounds
from bapo_megatron.algo.contributions import contribution_stats
from bapo_megatron.algo.policy_loss import (
    aggregate,
    bapo_loss,
    clipped_surrogate,
    importance_ratio,
    loss_normalizer,
    search_statistics,
    truncated_importance_weights,
)
from bapo_megatron.algo.reduction import ReduceFn, all_reduce_sum, identity_reduce
from bapo_megatron.algo.search_plan import SearchPlan
from bapo_megatron.algo.vocab_parallel import token_logprobs_and_entropy

__all__ = [
    "BoundDecision",
    "ReduceFn",
    "SearchPlan",
    "aggregate",
    "all_reduce_sum",
    "bapo_loss",
    "choose_bounds",
    "clipped_surrogate",
    "contribution_stats",
    "identity_reduce",
    "importance_ratio",
    "loss_normalizer",
    "search_statistics",
    "token_logprobs_and_entropy",
    "truncated_importance_weights",
]
