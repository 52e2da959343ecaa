"""The policy loss's configuration: the clip presets, the clip-bound search and the loss section
(with its extra terms: the entropy bonus, the mismatch band of the off-policy corrections, and
the overlong penalty and filter)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from bapo_megatron.config.overlong import OverlongConfig

Schedule = Literal["paper", "reference"]
Semantics = Literal["gradient", "surrogate"]
TargetUnit = Literal["share", "ratio"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
Granularity = Literal["step", "microbatch"]

AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Preset values come from docs/algorithm.md: `paper` is Algorithm 1 of arXiv 2510.18927, `reference`
# the authors' verl recipe (yaml + policy_loss.py), `grpo` and `clip-higher` the fixed-clip
# baselines the paper compares with (a fixed clip is a search with empty ranges), `verl-grpo` and
# `verl-dapo` verl's vanilla PPO loss at its defaults (clip_ratio 0.2, clip_ratio_c 3.0), the
# second with DAPO's clip-higher (clip_ratio_high 0.28) (docs/algorithm.md section 7.1).
CLIP_PRESETS: dict[str, dict[str, object]] = {
    "paper": {
        "schedule": "paper",
        "semantics": "gradient",
        "target_unit": "share",
        "target": 0.4,
        "c_low_start": 0.6,
        "c_low_max": 0.9,
        "c_low_step": 0.02,
        "c_high_start": 1.2,
        "c_high_max": 3.0,
        "c_high_step": 0.05,
        "dual_clip": None,
        "granularity": "step",
    },
    "reference": {
        "schedule": "reference",
        "semantics": "surrogate",
        "target_unit": "ratio",
        "target": 1.0,
        "c_low_start": 0.6,
        "c_low_max": 0.8,
        "c_low_step": 0.05,
        "c_high_start": 1.2,
        "c_high_max": 2.0,
        "c_high_step": 0.05,
        "dual_clip": 3.0,
        "granularity": "microbatch",
    },
    "grpo": {
        "schedule": "paper",
        "semantics": "gradient",
        "target_unit": "share",
        "target": 0.4,
        "c_low_start": 0.8,
        "c_low_max": 0.8,
        "c_low_step": 0.02,
        "c_high_start": 1.2,
        "c_high_max": 1.2,
        "c_high_step": 0.05,
        "dual_clip": None,
    },
    "clip-higher": {
        "schedule": "paper",
        "semantics": "gradient",
        "target_unit": "share",
        "target": 0.4,
        "c_low_start": 0.8,
        "c_low_max": 0.8,
        "c_low_step": 0.02,
        "c_high_start": 1.28,
        "c_high_max": 1.28,
        "c_high_step": 0.05,
        "dual_clip": None,
    },
}
# verl's vanilla PPO loss always applies its dual clip (clip_ratio_c, default 3.0): GRPO's and
# DAPO's fixed bounds with it (docs/algorithm.md section 7.1)
CLIP_PRESETS["verl-grpo"] = {**CLIP_PRESETS["grpo"], "dual_clip": 3.0}
CLIP_PRESETS["verl-dapo"] = {**CLIP_PRESETS["clip-higher"], "dual_clip": 3.0}


@dataclass(kw_only=True)
class ClipSearchConfig:
    """The clip bounds and the adaptive search that moves them (docs/algorithm.md sections 2-4).

    Built from a preset with :meth:`from_preset`; a YAML section with ``preset: <name>`` starts
    from that preset and overrides the fields it names. Bounds are explicit ratio bounds
    (0.6, 1.2), not epsilons.
    """

    preset: str = "paper"
    """Name of the preset the values started from (informational once fields are overridden)."""
    schedule: Schedule = "paper"
    """`paper`: Algorithm 1, c_high moves first, only whole steps inside the range.
    `reference`: the authors' code, c_low moves first, the last step clamped to the max."""
    semantics: Semantics = "gradient"
    """`gradient`: only tokens that carry gradient count, by |A|*r. `surrogate`: every token counts
    at its clipped surrogate value (Eq. 8 as printed and the authors' code)."""
    target_unit: TargetUnit = "share"
    """`share`: rho = P/(P+N) >= target. `ratio`: q = P/N >= target."""
    target: float = 0.4
    """rho0 (share) or q0 (ratio) the search tries to reach."""
    c_low_start: float = 0.6
    """Lower ratio bound every update starts from (a-)."""
    c_low_max: float = 0.9
    """Largest value the search may raise c_low to (b-)."""
    c_low_step: float = 0.02
    """Step of c_low (delta2)."""
    c_high_start: float = 1.2
    """Upper ratio bound every update starts from (a+)."""
    c_high_max: float = 3.0
    """Largest value the search may raise c_high to (b+)."""
    c_high_step: float = 0.05
    """Step of c_high (delta1)."""
    dual_clip: float | None = None
    """Dual-clip constant C > 1 for negative advantages (loss capped at |A|*C); None disables."""
    granularity: Granularity = "step"
    """Where the bounds are decided (docs/algorithm.md section 5). `step`: once per optimizer
    step from all of its micro-batches (the paper; costs one no-grad forward pass).
    `microbatch`: per micro-batch, on that micro-batch index over the data-parallel ranks (the
    authors' code). Fixed clips need no decision and behave the same either way."""

    def __post_init__(self) -> None:
        prefix = "loss.clip"
        if self.schedule not in ("paper", "reference"):
            raise ValueError(
                f"{prefix}.schedule must be 'paper' or 'reference', got {self.schedule!r}"
            )
        if self.semantics not in ("gradient", "surrogate"):
            raise ValueError(
                f"{prefix}.semantics must be 'gradient' or 'surrogate', got {self.semantics!r}"
            )
        if self.target_unit not in ("share", "ratio"):
            raise ValueError(
                f"{prefix}.target_unit must be 'share' or 'ratio', got {self.target_unit!r}"
            )
        for name in (
            "target",
            "c_low_start",
            "c_low_max",
            "c_low_step",
            "c_high_start",
            "c_high_max",
            "c_high_step",
        ):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{prefix}.{name} must be a finite number, got {value!r}")
        if self.target_unit == "share" and not 0.0 < self.target < 1.0:
            raise ValueError(
                f"{prefix}.target is a share P/(P+N) and must lie in (0, 1), got {self.target}"
            )
        if self.target_unit == "ratio" and not self.target > 0.0:
            raise ValueError(f"{prefix}.target is a ratio P/N and must be > 0, got {self.target}")
        if not 0.0 < self.c_low_start <= self.c_low_max <= 1.0:
            raise ValueError(
                f"{prefix}: expected 0 < c_low_start <= c_low_max <= 1, "
                f"got c_low_start={self.c_low_start}, c_low_max={self.c_low_max}"
            )
        if not 1.0 <= self.c_high_start <= self.c_high_max:
            raise ValueError(
                f"{prefix}: expected 1 <= c_high_start <= c_high_max, "
                f"got c_high_start={self.c_high_start}, c_high_max={self.c_high_max}"
            )
        if self.c_low_step <= 0.0:
            raise ValueError(f"{prefix}.c_low_step must be > 0, got {self.c_low_step}")
        if self.c_high_step <= 0.0:
            raise ValueError(f"{prefix}.c_high_step must be > 0, got {self.c_high_step}")
        if self.granularity not in ("step", "microbatch"):
            raise ValueError(
                f"{prefix}.granularity must be 'step' or 'microbatch', got {self.granularity!r}"
            )
        if self.dual_clip is not None and not (
            self.dual_clip > 1.0 and math.isfinite(self.dual_clip)
        ):
            raise ValueError(
                f"{prefix}.dual_clip must be > 1 (or null to disable), got {self.dual_clip}"
            )

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> ClipSearchConfig:
        """The named preset (`paper`, `reference`, `grpo`, `clip-higher`, `verl-grpo`,
        `verl-dapo`) with ``overrides`` applied."""
        if name not in CLIP_PRESETS:
            raise ValueError(
                f"loss.clip.preset must be one of {sorted(CLIP_PRESETS)}, got {name!r}"
            )
        return cls(preset=name, **{**CLIP_PRESETS[name], **overrides})


@dataclass(kw_only=True)
class LossConfig:
    """The policy loss: clipped surrogate, its aggregation, the clip-bound search and the extra
    terms (entropy bonus, mismatch band, overlong penalty and filter)."""

    clip: ClipSearchConfig = field(default_factory=ClipSearchConfig)
    """Clip bounds and their adaptive search."""
    aggregation: Aggregation = "token-mean"
    """`token-mean`: sum over the optimizer step's response tokens / their global count;
    `seq-mean-token-mean`: mean over sequences of each sequence's token mean;
    `seq-mean-token-sum`: mean over sequences of each sequence's token sum."""
    truncated_is_cap: float | None = None
    """Cap C of the off-policy correction's importance weight (``algorithm.off_policy_correction``;
    set alone, it means `token-truncate`: min(exp(recomputed - behaviour), C) multiplies the
    loss); None: no weight."""
    mismatch_band_low: float | None = None
    """a, the lower end of the band [a, b] of the masking off-policy corrections
    (``algorithm.off_policy_correction`` `token-mask`, `icepop`, `sequence-mask`,
    `geometric-mask`): a token or sequence whose engine/actor ratio falls outside it is masked.
    Set with ``mismatch_band_high`` (0 <= a <= 1 <= b); None: the band [1/C, C] of the cap
    C = ``truncated_is_cap``."""
    mismatch_band_high: float | None = None
    """b, the upper end of that band (set with ``mismatch_band_low``)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: the loss becomes the policy loss minus this times the
    response tokens' full-vocabulary entropy, aggregated as ``aggregation`` says. The bonus is no
    part of the clip search's contributions. 0: no bonus (and no ``actor/entropy_bonus``
    metric)."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """The soft length penalty on the reward and the filter of responses cut off at the cap."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"loss.aggregation must be one of {list(AGGREGATIONS)}, got {self.aggregation!r}"
            )
        if self.truncated_is_cap is not None and not self.truncated_is_cap > 0:
            raise ValueError(
                f"loss.truncated_is_cap must be > 0 or null, got {self.truncated_is_cap!r}"
            )
        if not (math.isfinite(self.entropy_coef) and self.entropy_coef >= 0):
            raise ValueError(
                f"loss.entropy_coef must be a finite number >= 0, got {self.entropy_coef!r}"
            )
        self._check_mismatch_band()

    def _check_mismatch_band(self) -> None:
        low, high = self.mismatch_band_low, self.mismatch_band_high
        if (low is None) != (high is None):
            raise ValueError(
                "loss.mismatch_band_low and loss.mismatch_band_high are set together (or both "
                f"left null), got mismatch_band_low={low!r}, mismatch_band_high={high!r}"
            )
        if low is None:
            return
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(
                f"loss.mismatch_band_low and loss.mismatch_band_high must be finite numbers, "
                f"got {low!r} and {high!r}"
            )
        if low > high:
            raise ValueError(
                f"loss.mismatch_band_low={low} is above loss.mismatch_band_high={high}: "
                "the band [a, b] needs a <= b"
            )
        if not 0 <= low <= 1 <= high:
            raise ValueError(
                f"loss.mismatch_band_low={low}, loss.mismatch_band_high={high}: the band must "
                "contain 1 (0 <= a <= 1 <= b), or the tokens on which the engine and the actor "
                "agree would be masked"
            )

    def mismatch_band(self) -> tuple[float, float] | None:
        """``(a, b)`` when the band is set, else None (the masks then use [1/C, C])."""
        if self.mismatch_band_low is None:
            return None
        return self.mismatch_band_low, self.mismatch_band_high
