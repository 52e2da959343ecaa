"""The tiny CPU run with a KL reference and with dynamic sampling's refill: what each changes
in what trains, and that neither changes anything when it applies nothing."""

from __future__ import annotations

import pytest

from tests.helpers.train_runs import rollout_records, run_in_process, update_records

PROMPTS = 4  # rollout.prompts_per_step of the FAST runs
STEPS = ["train.steps=3"]
TRAINED = ("loss", "grad_norm", "entropy", "bapo/c_low", "bapo/c_high", "response_tokens")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, warm_start):
    return run_in_process(tmp_path_factory.mktemp("plain"), *warm_start[0], *STEPS)


def _trained(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in TRAINED} for r in update_records(records)]


def test_a_kl_coefficient_of_zero_measures_and_trains_exactly_as_without(
    tmp_path, warm_start, plain
):
    records = run_in_process(tmp_path, *warm_start[0], *STEPS, 'algorithm.kl={"coef": 0}')
    assert _trained(records) == _trained(plain)
    for ours, theirs in zip(rollout_records(records), rollout_records(plain), strict=True):
        assert ours["reward/mean"] == theirs["reward/mean"]
    updates = update_records(records)
    assert updates[0]["kl/mean"] < 1e-6 < updates[-1]["kl/mean"]  # the policy leaves the start
    assert all(u["kl/loss"] == 0.0 for u in updates)
    assert all("kl/rollout_mean" in r for r in rollout_records(records))


def test_the_kl_loss_term_pulls_the_policy_towards_its_start(tmp_path, warm_start, plain):
    records = run_in_process(tmp_path, *warm_start[0], *STEPS, 'algorithm.kl={"coef": 2.0}')
    ours, theirs = update_records(records), update_records(plain)
    # at the start the policy is the reference: the term and its gradient vanish
    assert ours[0]["grad_norm"] == pytest.approx(theirs[0]["grad_norm"], rel=1e-4)
    assert ours[-1]["kl/loss"] == pytest.approx(2.0 * ours[-1]["kl/mean"], rel=1e-6)
    assert ours[-1]["kl/loss"] > 0 and ours[-1]["grad_norm"] != theirs[-1]["grad_norm"]


def test_refill_generates_rounds_until_the_groups_carry_signal(tmp_path, warm_start):
    filtered = ["algorithm.filter_equal_groups=true", *STEPS]
    records = run_in_process(tmp_path, *warm_start[0], *filtered, "algorithm.max_refill_rounds=3")
    rollouts = rollout_records(records)
    assert any(r["dynamic_sampling/refill_rounds"] > 0 for r in rollouts)  # or it proves little
    for r in rollouts:
        rounds = r["dynamic_sampling/refill_rounds"]
        assert 0 <= rounds <= 3
        # every round is a whole share of prompts, scored
        assert r["rollout/finished_groups"] == PROMPTS * (1 + rounds)
        kept = r["rollout/informative_groups"] - r["dynamic_sampling/surplus_groups"]
        assert kept + r["dynamic_sampling/short_groups"] == PROMPTS
        if r["dynamic_sampling/short_groups"]:  # short only once the bound is reached
            assert rounds == 3
        elif rounds:  # stopped at the first round that filled the share
            assert r["rollout/informative_groups"] >= PROMPTS
