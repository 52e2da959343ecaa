"""The KL regularisation towards a frozen reference policy (``algorithm.kl``, docs/algorithm.md
section 6.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

KLEstimator = Literal["k1", "k2", "k3"]
KLPlacement = Literal["loss", "reward"]
INITIAL_REFERENCE = "initial"


@dataclass(kw_only=True)
class KLConfig:
    """A frozen reference policy on the actor's layout, its log-probs computed with the old
    log-probs, and a KL term towards it in the loss or in the reward."""

    coef: float = 0.0
    """beta, the weight of the KL term (>= 0). 0: the reference's KL is measured and logged
    (``kl/*``) but trains nothing."""
    estimator: KLEstimator = "k3"
    """Per-token estimator of KL(pi || pi_ref) from log r = log pi_ref - log pi of the sampled
    token: `k1` = -log r, `k2` = (log r)^2 / 2, `k3` = r - 1 - log r (unbiased, never negative;
    verl's "low_var_kl")."""
    placement: KLPlacement = "loss"
    """`loss`: beta times the estimator at the policy being trained is added to the loss,
    aggregated as the policy loss (verl's ``use_kl_loss``); its gradient stays out of BAPO's
    contribution statistics. `reward`: beta times the sequence's summed estimator at the
    sampling policy is subtracted from its reward before the group advantages."""
    reference: str | None = INITIAL_REFERENCE
    """The reference's weights: `initial` (the policy's starting weights: ``train.model_path``,
    ``train.load_checkpoint``, or the random start after ``warmup``, which is saved to
    ``<output_dir>/reference`` for resumes), the path of a Megatron checkpoint folder (any layout)
    or of an HF folder of the same model; null: no reference (then ``coef`` must be 0)."""
    offload: bool = False
    """Keep the reference's weights in host memory and move them to the device only for its
    log-prob pass (slower; frees its weights' memory during training and generation)."""

    def __post_init__(self) -> None:
        prefix = "algorithm.kl"
        if isinstance(self.coef, bool) or not self.coef >= 0:
            raise ValueError(f"{prefix}.coef must be a number >= 0, got {self.coef!r}")
        if self.estimator not in get_args(KLEstimator):
            raise ValueError(
                f"{prefix}.estimator must be one of {list(get_args(KLEstimator))}, "
                f"got {self.estimator!r}"
            )
        if self.placement not in get_args(KLPlacement):
            raise ValueError(
                f"{prefix}.placement must be one of {list(get_args(KLPlacement))}, "
                f"got {self.placement!r}"
            )
        if self.reference is not None and not self.reference.strip():
            raise ValueError(
                f"{prefix}.reference must be 'initial', a checkpoint or HF folder, or null, "
                f"got {self.reference!r}"
            )
        if self.coef > 0 and self.reference is None:
            raise ValueError(
                f"{prefix}.coef is {self.coef!r} but {prefix}.reference is null: a KL term needs "
                f"a reference policy ('{INITIAL_REFERENCE}' or a checkpoint folder)"
            )

    @property
    def has_reference(self) -> bool:
        """Whether a reference policy is built (its log-probs computed every rollout step)."""
        return self.reference is not None
