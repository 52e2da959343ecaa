"""Experience between the rollout and the actor: scored groups of samples, the order prompts
are visited in, the replay buffer, and the conversion to the actor's token-aligned batch.

A :class:`Group` is one prompt's ``n`` samples with their rewards and GRPO advantages; groups
are the unit of every off-policy mechanism (mini-batches, lag, replay), since advantages are
only defined within a whole group. Every token keeps the behaviour log-prob and the policy
version it was sampled with.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from bapo_megatron.actor.batch import PolicyBatch
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.data.record_fields import ChatMessage
from bapo_megatron.rollout.protocol import RolloutSample


@dataclass
class Group:
    """One prompt's samples, scored."""

    prompt_id: str
    samples: list[RolloutSample]
    rewards: list[float]
    advantages: list[float]

    @property
    def oldest_version(self) -> int:
        """Oldest policy version any of its tokens was sampled with."""
        return min((min(s.versions) for s in self.samples if s.versions), default=0)

    def with_samples(self, kept: list[bool]) -> Group:
        """The group with only the samples ``kept`` marks (itself when it marks all)."""
        if all(kept):
            return self
        pick = [i for i, keep in enumerate(kept) if keep]
        return dataclasses.replace(
            self,
            samples=[self.samples[i] for i in pick],
            rewards=[self.rewards[i] for i in pick],
            advantages=[self.advantages[i] for i in pick],
        )

    def to_plain(self) -> dict:
        """The group as plain data (dicts, lists, numbers, strings), as checkpoints store it."""
        return {
            "prompt_id": self.prompt_id,
            "samples": [sample_to_plain(s) for s in self.samples],
            "rewards": list(self.rewards),
            "advantages": list(self.advantages),
        }

    @classmethod
    def from_plain(cls, plain: dict) -> Group:
        """Undo :meth:`to_plain`."""
        return cls(
            prompt_id=plain["prompt_id"],
            samples=[sample_from_plain(s) for s in plain["samples"]],
            rewards=list(plain["rewards"]),
            advantages=list(plain["advantages"]),
        )


def sample_to_plain(sample: RolloutSample) -> dict:
    """A rollout sample as a plain dict of its fields (lists copied)."""
    return dataclasses.asdict(sample)


def sample_from_plain(plain: dict) -> RolloutSample:
    """Undo :func:`sample_to_plain`."""
    return RolloutSample(**plain)


def row_to_plain(row: PromptRow) -> dict:
    """A prompt row as a plain dict of its fields."""
    return dataclasses.asdict(row)


def row_from_plain(plain: dict) -> PromptRow:
    """Undo :func:`row_to_plain` (a prompt of chat messages comes back as its messages)."""
    prompt = plain["prompt"]
    if not isinstance(prompt, str):
        prompt = tuple(ChatMessage(**message) for message in prompt)
    return PromptRow(**{**plain, "prompt": prompt})


def prompt_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Indices of the prompt set in the order epoch ``epoch`` visits them."""
    order = list(range(num_prompts))
    if shuffle:
        random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def prompts_at(position: int, count: int, num_prompts: int, seed: int, shuffle: bool) -> list[int]:
    """The ``count`` prompt indices starting at global ``position`` of the endless stream of
    epochs (each a fresh permutation): a pure function of its arguments, so the data position
    of a checkpoint is a single integer."""
    indices = []
    while len(indices) < count:
        epoch, offset = divmod(position + len(indices), num_prompts)
        order = prompt_order(num_prompts, seed, epoch, shuffle)
        indices.extend(order[offset : offset + count - len(indices)])
    return indices


def to_policy_batch(groups: list[Group], pad_token_id: int) -> tuple[PolicyBatch, torch.Tensor]:
    """The actor's batch of ``groups`` (one row per sample, right-padded) with behaviour
    log-probs as ``old_logprobs`` and each sample's advantage, and the [n, s] int64 tensor of
    the policy version of every response token (-1 elsewhere). When the engine recorded routes
    (``RolloutSample.routes``), the batch carries them (-1: no route, the last sampled token
    and padding)."""
    samples = [(s, adv) for g in groups for s, adv in zip(g.samples, g.advantages)]
    length = max((len(s.prompt_token_ids) + len(s.token_ids) for s, _ in samples), default=2)
    rows = len(samples)
    tokens = torch.full((rows, length), pad_token_id, dtype=torch.long)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    old = torch.zeros(rows, length, dtype=torch.float32)
    versions = torch.full((rows, length), -1, dtype=torch.long)
    advantages = torch.zeros(rows, dtype=torch.float32)
    for row, (sample, advantage) in enumerate(samples):
        start, ids = len(sample.prompt_token_ids), sample.prompt_token_ids + sample.token_ids
        end = len(ids)
        tokens[row, :end] = torch.tensor(ids)
        mask[row, start:end] = True
        old[row, start:end] = torch.tensor(sample.logprobs, dtype=torch.float32)
        versions[row, start:end] = torch.tensor(sample.versions)
        advantages[row] = advantage
    batch = PolicyBatch(
        tokens=tokens,
        response_mask=mask,
        old_logprobs=old,
        advantages=advantages,
        routes=_routes(samples, length),
    )
    return batch, versions


def _routes(samples: list, length: int) -> torch.Tensor | None:
    """[n, length, moe_layers, topk] expert ids of the samples that have routes, or None."""
    shape = next((torch.tensor(s.routes).shape[1:] for s, _ in samples if s.routes), None)
    if shape is None:
        return None
    routes = torch.full((len(samples), length, *shape), -1, dtype=torch.long)
    for row, (sample, _) in enumerate(samples):
        if sample.routes:
            routes[row, : len(sample.routes)] = torch.tensor(sample.routes)
    return routes


def split_groups(groups: list[Group], parts: int) -> list[list[Group]]:
    """``groups`` in ``parts`` contiguous mini-batches of near-equal size (some may be empty)."""
    size, extra = divmod(len(groups), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        out.append(groups[start:end])
        start = end
    return out


class ReplayBuffer:
    """Groups of earlier rollout steps, replayed into later training batches.

    Holds at most ``capacity`` groups (the oldest evicted first) and never returns a group whose
    oldest token is more than ``max_staleness`` policy versions behind the current one.
    """

    def __init__(self, capacity: int, max_staleness: int) -> None:
        self.capacity, self.max_staleness = capacity, max_staleness
        self.groups: list[Group] = []

    def add(self, groups: list[Group]) -> None:
        self.groups.extend(groups)
        del self.groups[: max(0, len(self.groups) - self.capacity)]

    def evict_stale(self, version: int) -> None:
        self.groups = [g for g in self.groups if version - g.oldest_version <= self.max_staleness]

    def sample(self, count: int, version: int, rng: random.Random) -> list[Group]:
        """Up to ``count`` distinct groups not staler than allowed at policy ``version``."""
        self.evict_stale(version)
        return rng.sample(self.groups, min(count, len(self.groups)))

    def state_dict(self) -> dict:
        """The buffer's groups as plain data (see :meth:`Group.to_plain`)."""
        return {"groups": [group.to_plain() for group in self.groups]}

    def load_state_dict(self, state: dict) -> None:
        """Undo :meth:`state_dict`."""
        self.groups = [Group.from_plain(group) for group in state["groups"]]
