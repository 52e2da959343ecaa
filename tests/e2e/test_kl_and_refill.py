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


def test_a_config_without_the_new_fields_trains_as_with_them_off(tmp_path, warm_start, plain):
    off = ["algorithm.kl=null", "algorithm.max_refill_rounds=null"]
    records = run_in_process(tmp_path, *warm_start[0], *STEPS, *off)
    timing = ("time/", "throughput/")
    assert [{k: v for k, v in r.items() if not k.startswith(timing)} for r in records] == [
        {k: v for k, v in r.items() if not k.startswith(timing)} for r in plain
    ]
    assert not any(k.startswith(("kl/", "dynamic_sampling/")) for r in plain for k in r)


def test_a_random_start_reference_is_found_again_by_a_resumed_run(tmp_path):
    # the reference is the policy after its warm-up, which only the first run computed
    kl = ['algorithm.kl={"coef": 0.5}', "warmup.steps=10", "checkpoint.interval=1"]
    whole = run_in_process(tmp_path / "whole", *kl, "train.steps=2")
    assert (tmp_path / "whole" / "reference" / "bapo_checkpoint.json").is_file()
    run_in_process(tmp_path / "split", *kl, "train.steps=1")
    resumed = run_in_process(tmp_path / "split", *kl, "train.steps=2")
    keys = ("kl/mean", "kl/loss", "grad_norm", "loss")
    assert [{k: r[k] for k in keys} for r in update_records(resumed)] == [
        {k: r[k] for k in keys} for r in update_records(whole)
    ]
    # the short warm-up earns no reward, so the policy stays at its start: the resumed run's
    # reference is that start exactly (one drawn or warmed up anew would differ from it)
    assert all(r["kl/rollout_mean"] < 1e-9 for r in rollout_records(resumed))
