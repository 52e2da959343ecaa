r"""The KL term towards a frozen reference policy (docs/algorithm.md section 6.1).

From log r_t = log pi_ref(y_t) - log pi(y_t) of each sampled response token, clamped to
[-20, 20] as the policy ratio is, the per-token estimators of KL(pi || pi_ref) under samples of
pi (Schulman's k1, k2, k3):

    k1 = -log r        k2 = (log r)^2 / 2        k3 = r - 1 - log r

k1 is unbiased and may be negative; k3 is unbiased and never negative (verl's "low_var_kl");
k2 is biased and never negative. As a loss term the estimator is aggregated like the policy
loss and weighted by beta; as a reward penalty each sequence's reward loses beta times its
estimator summed over its response tokens. Either way the term is apart from BAPO's search:
P and N count the policy-gradient tokens only.
"""

from __future__ import annotations

import torch

from bapo_megatron.algo.policy_loss import LOG_RATIO_CLAMP, aggregate

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token estimator (``[batch, tokens]``, at least float32, differentiable in
    ``logp``); values off the response are whatever the inputs give there."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    dtype = torch.promote_types(torch.promote_types(logp.dtype, logp_ref.dtype), torch.float32)
    log_ratio = (logp_ref.detach().to(dtype) - logp.to(dtype)).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio  # expm1: no cancellation near r = 1


def kl_loss_term(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    estimator: str,
    aggregation: str,
    normalizer: torch.Tensor | float,
    sequence_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coef * aggregated estimator, sum of the estimator over the response tokens)``: the
    term to add to this micro-batch's policy loss (aggregated over the step's global
    ``normalizer`` as :func:`~bapo_megatron.algo.policy_loss.aggregate`) and, detached in
    float64, what the step's ``kl/mean`` is summed from."""
    mask = mask.bool()
    per_token = kl_estimate(logp, logp_ref, estimator)
    term = coef * aggregate(per_token, mask, aggregation, normalizer, sequence_ids)
    total = torch.where(mask, per_token.detach(), 0.0).sum().double()
    return term, total


def sequence_kl(
    logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """``[batch]`` float64: each row's estimator summed over its response tokens."""
    per_token = kl_estimate(logp.detach().double(), logp_ref.double(), estimator)
    return torch.where(mask.bool(), per_token, 0.0).sum(-1)


def kl_penalized_rewards(
    rewards: torch.Tensor, sequence_kls: torch.Tensor, coef: float
) -> torch.Tensor:
    """Rewards less ``coef`` times each sample's summed estimator (same shapes, float64): the
    reward placement's scores, which the group advantages are then computed from."""
    if rewards.shape != sequence_kls.shape:
        raise ValueError(
            f"sequence KLs of shape {tuple(sequence_kls.shape)} do not match the rewards' "
            f"{tuple(rewards.shape)}"
        )
    return rewards.double() - coef * sequence_kls.double()
