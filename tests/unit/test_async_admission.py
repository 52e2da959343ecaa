"""Asynchronous training's rules (:mod:`bapo_megatron.trainer.admission`) and its staleness
histogram, against direct enumeration."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from bapo_megatron.data.experience import Group
from bapo_megatron.data.prompts import PromptRow
from bapo_megatron.rollout.protocol import RolloutSample
from bapo_megatron.trainer.admission import admission_limit, mixed_version_samples, stale_groups
from bapo_megatron.trainer.metrics import staleness


@pytest.mark.parametrize("seed", range(20))
def test_admitted_items_train_within_eta_and_nothing_admissible_is_held_back(seed):
    draw = random.Random(seed)
    eta, per_step = draw.randint(1, 5), draw.randint(1, 3)
    step, last = draw.randint(0, 10), draw.randint(11, 30)
    version = step * per_step + draw.randint(0, 2)
    pushed = version - draw.randint(0, eta)
    limit = admission_limit(
        step=step,
        version=version,
        pushed_version=pushed,
        max_staleness=eta,
        versions_per_step=per_step,
        last_step=last,
    )
    # item j starts on weights >= pushed and trains from version + (j - step) * per_step on
    fits = [j for j in range(step, last + 1) if version + (j - step) * per_step - pushed <= eta]
    assert limit == max([step, *fits])


def test_the_step_s_own_item_is_admitted_even_past_eta_and_never_past_the_run():
    common = {"versions_per_step": 1, "last_step": 5}
    assert admission_limit(step=3, version=9, pushed_version=2, max_staleness=1, **common) == 3
    assert admission_limit(step=4, version=4, pushed_version=4, max_staleness=4, **common) == 5


def sample(versions: list[int]) -> RolloutSample:
    return RolloutSample(
        prompt_index=0,
        sample_index=0,
        prompt_token_ids=[1],
        token_ids=[2] * len(versions),
        logprobs=[0.0] * len(versions),
        versions=versions,
        finish_reason="stop",
    )


def test_a_group_is_stale_when_any_token_is_older_than_eta():
    groups = [
        Group(
            prompt_id="a", samples=[sample([5, 6]), sample([7])], rewards=[0, 1], advantages=[0, 0]
        ),
        Group(
            prompt_id="b", samples=[sample([4, 7]), sample([7])], rewards=[0, 1], advantages=[0, 0]
        ),
        Group(prompt_id="c", samples=[sample([]), sample([6])], rewards=[0, 1], advantages=[0, 0]),
    ]
    assert stale_groups(groups, version=7, max_staleness=2) == [False, True, False]
    assert stale_groups(groups, version=8, max_staleness=2) == [True, True, False]
    row = PromptRow(id="a", prompt="p", answer="1")
    paused = [(row, [sample([1, 1]), sample([1, 2])]), (row, [sample([3, 4, 5])])]
    assert mixed_version_samples(paused) == 2


def test_the_staleness_histogram_counts_every_token_once():
    context = SimpleNamespace(dp_group=None, device="cpu")  # one process: no reduction
    generator = torch.Generator().manual_seed(0)
    versions = torch.randint(-1, 10, (6, 9), generator=generator)  # -1: not a response token
    out = staleness(versions, 10, context, histogram_bins=4)
    behind = [10 - v for v in versions.flatten().tolist() if v >= 0]
    for i in range(4):
        assert out[f"staleness/share_{i}"] == pytest.approx(behind.count(i) / len(behind))
    assert out["staleness/share_4+"] == pytest.approx(sum(b >= 4 for b in behind) / len(behind))
    assert out["staleness/max"] == max(behind)
    assert out["staleness/mean"] == pytest.approx(sum(behind) / len(behind))
