"""The pure rules of asynchronous training (``algorithm.max_staleness`` = eta >= 1): which
rollout items the engines may start, which groups exceed eta, and how many samples an in-flight
weight update touched (:mod:`bapo_megatron.trainer.async_rollout` applies them).

A rollout item is one rollout step's prompts of one replica. Item ``j`` trains in rollout step
``j``; the engine generates it on the newest weights the trainer had sent when it was admitted
(the engine loads them before it starts the item) or on newer ones loaded while it runs. So the
engines may start item ``j`` during step ``s`` while

    version + (j - s) * optimizer_steps_per_rollout - pushed_version <= eta

(the policy version at the start of item ``j``'s training, counting every mini-batch of the
steps between, minus the version the engines already have): nothing is generated only to be
thrown away. Item ``s`` itself is always admitted (the step needs it). A group that still
exceeds eta when its step trains (the admission above prevents it; this is the safety net) is
dropped and counted.
"""

from __future__ import annotations

from bapo_megatron.data.experience import Group
from bapo_megatron.trainer.state import PausedGroup


def admission_limit(
    *,
    step: int,
    version: int,
    pushed_version: int,
    max_staleness: int,
    versions_per_step: int,
    last_step: int,
) -> int:
    """The last rollout item the engines may start during rollout step ``step`` (at least
    ``step``, at most ``last_step``); see the module docstring."""
    headroom = max_staleness - (version - pushed_version)
    ahead = max(0, headroom // versions_per_step)
    return max(step, min(step + ahead, last_step))


def stale_groups(groups: list[Group], *, version: int, max_staleness: int) -> list[bool]:
    """For each group, whether a token of it was sampled before ``version - max_staleness``."""
    return [group.oldest_version < version - max_staleness for group in groups]


def mixed_version_samples(groups: list[PausedGroup]) -> int:
    """Samples whose tokens were sampled under more than one policy version (a weight update
    arrived while they were generated)."""
    return sum(len(set(s.versions)) > 1 for _, samples in groups for s in samples)
