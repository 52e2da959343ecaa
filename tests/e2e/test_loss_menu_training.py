"""The loss's extra terms in the tiny CPU run: a config written without them trains exactly as
one that writes them at their defaults, and each one, switched on, changes what trains and says
so in its metrics (overlong penalty and filter, the band masks, the entropy bonus, the verl
presets and verl's rule for a group of one)."""

from __future__ import annotations

import math

import pytest

from tests.helpers.train_runs import (
    assert_same_run,
    rollout_records,
    run_in_process,
    update_records,
)

DEFAULTS_WRITTEN = [
    "loss.entropy_coef=0.0",
    "loss.mismatch_band_low=null",
    "loss.mismatch_band_high=null",
    "loss.overlong.buffer_length=0",
    "loss.overlong.penalty_factor=1.0",
    "loss.overlong.filter=false",
    "algorithm.one_sample_advantage=zero",
]
LAGGED = ["algorithm.old_logprobs=recompute", "algorithm.rollout_lag=1"]
STEPS = 3
UPDATES = 2 * STEPS  # two mini-batches per rollout step


@pytest.fixture(scope="module")
def plain(tmp_path_factory, warm_start):
    """The tiny run as configs wrote it before the extra terms existed."""
    return run_in_process(tmp_path_factory.mktemp("plain"), *warm_start[0], f"train.steps={STEPS}")


def losses(records: list[dict]) -> list[float]:
    return [u["loss"] for u in update_records(records)]


def assert_trained(records: list[dict], updates: int = UPDATES) -> None:
    updates_ = update_records(records)
    assert len(updates_) == updates
    assert all(math.isfinite(u["loss"]) and math.isfinite(u["grad_norm"]) for u in updates_)
    assert any(u["grad_norm"] > 0 for u in updates_)


def test_the_new_fields_at_their_defaults_train_bit_for_bit_as_before(tmp_path, warm_start, plain):
    written = run_in_process(tmp_path, *warm_start[0], f"train.steps={STEPS}", *DEFAULTS_WRITTEN)
    assert_same_run(written, plain, rollout_steps=STEPS, updates=UPDATES, bitwise=True)
    for a, b in zip(written, plain):
        assert set(a) == set(b)  # no new metric either
        assert not any(k.startswith(("overlong/", "off_policy/")) for k in a)
        assert "actor/entropy_bonus" not in a


def test_the_overlong_penalty_and_filter_change_the_training(tmp_path, warm_start, plain):
    # the warmed-up policy often runs on to the cap of 16 tokens: those are penalized (and the
    # last 8 tokens before the cap too) and, filtered, never trained
    records = run_in_process(
        tmp_path,
        *warm_start[0],
        f"train.steps={STEPS}",
        "loss.overlong.buffer_length=8",
        "loss.overlong.penalty_factor=0.5",
        "loss.overlong.filter=true",
    )
    assert_trained(records)
    for step in rollout_records(records):
        truncated = step["rollout/truncated_fraction"]
        assert step["overlong/filtered_fraction"] == truncated
        assert step["overlong/penalized_fraction"] >= truncated
        assert -0.5 <= step["overlong/penalty_mean"] <= -0.5 * truncated
    assert any(s["overlong/filtered_fraction"] > 0 for s in rollout_records(records))
    # fewer response tokens train (the filtered ones are gone), and the losses differ
    trained = sum(u["response_tokens"] for u in update_records(records))
    assert trained < sum(u["response_tokens"] for u in update_records(plain))
    assert losses(records) != losses(plain)


@pytest.mark.parametrize("correction", ["token-mask", "icepop", "geometric-mask"])
def test_a_band_mask_touches_tokens_and_changes_the_training(tmp_path, warm_start, correction):
    band = ["loss.mismatch_band_low=0.98", "loss.mismatch_band_high=1.02"]
    steps = [f"train.steps={STEPS + 1}"]
    none = run_in_process(tmp_path / "none", *warm_start[0], *LAGGED, *steps)
    records = run_in_process(
        tmp_path / correction,
        *warm_start[0],
        *LAGGED,
        *steps,
        f"algorithm.off_policy_correction={correction}",
        *band,
    )
    assert_trained(records)
    stale = rollout_records(records)[2:]  # trained two versions after sampling
    shares = [s["off_policy/masked_token_share"] for s in stale]
    assert all(0 <= share <= 1 for share in shares) and any(share > 0 for share in shares)
    if correction != "geometric-mask":  # a sequence mask may take all or nothing of a step
        assert all(0 < share < 1 for share in shares), shares
    for step in stale:
        assert step["off_policy/clipped_token_share"] == step["off_policy/masked_token_share"]
        if correction == "token-mask":  # weights 0 or 1
            assert step["off_policy/weight_mean"] == pytest.approx(
                1 - step["off_policy/masked_token_share"]
            )
    assert losses(records) != losses(none)


def test_the_entropy_bonus_changes_the_training(tmp_path, warm_start, plain):
    records = run_in_process(
        tmp_path, *warm_start[0], f"train.steps={STEPS}", "loss.entropy_coef=0.01"
    )
    assert_trained(records)
    for update in update_records(records):
        assert update["actor/entropy_bonus"] == pytest.approx(0.01 * update["entropy"], rel=1e-5)
        assert update["actor/policy_loss"] == pytest.approx(
            update["loss"] + update["actor/entropy_bonus"], rel=1e-12
        )
    first = update_records(records)[0], update_records(plain)[0]
    assert first[0]["actor/policy_loss"] == pytest.approx(first[1]["loss"], rel=1e-6)
    assert first[0]["grad_norm"] != first[1]["grad_norm"]


def test_verls_preset_and_one_sample_rule_train(tmp_path, warm_start):
    records = run_in_process(
        tmp_path,
        *warm_start[0],
        f"train.steps={STEPS}",
        "loss.clip.preset=verl-dapo",
        "rollout.samples_per_prompt=1",
        "rollout.prompts_per_step=8",
        "algorithm.one_sample_advantage=reward",
    )
    assert_trained(records)
    for update in update_records(records):
        assert (update["bapo/c_low"], update["bapo/c_high"]) == (0.8, 1.28)
        assert update["bapo/search_steps"] == 0
    # raw rewards as advantages: every rewarded sample is a positive token
    assert any(u["bapo/positive_tokens"] > 0 for u in update_records(records))
