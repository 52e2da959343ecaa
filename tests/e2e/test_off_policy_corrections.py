"""The off-policy corrections (``algorithm.off_policy_correction``) in the training loop of the
tiny CPU example: each one trains on lagged data and reports its ``off_policy/*`` metrics, and
``sequence-mask`` with the tightest cap masks sequences, which the metrics and the updates
show."""

from __future__ import annotations

import math

import pytest

from tests.helpers.train_runs import rollout_records, run_in_process, update_records

# One rollout step of lag: step k trains the batch sampled at step k - 1, so from step 3 on the
# proximal log-probs (recomputed by the actor) and the behaviour ones are two updates apart.
LAGGED = ["algorithm.old_logprobs=recompute", "algorithm.rollout_lag=1", "train.steps=4"]
SEQUENCES = 4 * 4  # rollout.prompts_per_step x rollout.samples_per_prompt of the helper's runs
OFF_POLICY_KEYS = (
    "off_policy/weight_mean",
    "off_policy/clipped_token_share",
    "off_policy/clipped_sequence_share",
    "off_policy/masked_sequences",
    "off_policy/sequences",
)


def trained_steps(records: list[dict]) -> list[dict]:
    """The rollout records of the steps that trained (the first one only generates)."""
    rollouts = rollout_records(records)
    assert len(rollouts) == 4
    assert "logprob_diff/tokens" not in rollouts[0]
    return rollouts[1:]


@pytest.mark.parametrize(
    "correction", ["none", "token-truncate", "sequence-truncate", "sequence-mask"]
)
def test_each_correction_trains_and_reports_its_weights(tmp_path, warm_start, correction):
    cap = [] if correction == "none" else ["loss.truncated_is_cap=2.0"]
    records = run_in_process(
        tmp_path, *warm_start[0], *LAGGED, f"algorithm.off_policy_correction={correction}", *cap
    )
    updates = update_records(records)
    assert len(updates) == 3 * 2  # three trained rollout steps x two mini-batches
    assert all(math.isfinite(u["loss"]) and math.isfinite(u["grad_norm"]) for u in updates)
    assert any(u["grad_norm"] > 0 for u in updates)
    for step in trained_steps(records):
        if correction == "none":
            assert not any(k.startswith(("off_policy/", "is_weights/")) for k in step)
            continue
        weights = {k: step[k] for k in OFF_POLICY_KEYS}
        assert weights["off_policy/sequences"] == SEQUENCES, weights
        assert 0 < weights["off_policy/weight_mean"] <= 2.0, weights
        assert 0 <= weights["off_policy/clipped_token_share"] <= 1, weights
        assert 0 <= weights["off_policy/clipped_sequence_share"] <= 1, weights
        if correction == "sequence-mask":  # weights are 0 or 1: the mean is the kept share
            assert weights["off_policy/weight_mean"] == pytest.approx(
                1 - weights["off_policy/clipped_token_share"]
            )
            assert weights["off_policy/masked_sequences"] == round(
                weights["off_policy/clipped_sequence_share"] * SEQUENCES
            )
        else:
            assert weights["off_policy/masked_sequences"] == 0, weights
        if correction == "token-truncate":  # the names this weight always had are kept
            assert step["is_weights/mean"] == weights["off_policy/weight_mean"]
            assert step["is_weights/capped_fraction"] == weights["off_policy/clipped_token_share"]
        else:
            assert not any(k.startswith("is_weights/") for k in step)


def test_sequence_mask_with_the_tightest_cap_masks_sequences(tmp_path, warm_start):
    # cap 1 keeps only sequences whose proximal and behaviour log-probs sum to exactly the same
    # value: two updates apart sequences are masked, and a step whose sequences are all masked
    # has no gradient at all (the weights reach the loss, not only the metrics)
    records = run_in_process(
        tmp_path,
        *warm_start[0],
        *LAGGED,
        "algorithm.off_policy_correction=sequence-mask",
        "loss.truncated_is_cap=1.0",
    )
    steps = trained_steps(records)
    for step in steps[1:]:  # the stale ones
        masked = step["off_policy/masked_sequences"]
        assert masked > 0, step
        assert step["off_policy/weight_mean"] < 1
        assert step["off_policy/clipped_sequence_share"] == masked / SEQUENCES
    fully_masked = [s for s in steps if s["off_policy/masked_sequences"] == SEQUENCES]
    assert fully_masked, steps
    updates = update_records(records)
    for step in fully_masked:
        assert step["off_policy/weight_mean"] == 0.0
        trained = [u for u in updates if u["rollout_step"] == step["rollout_step"] - 1]
        assert len(trained) == 2
        assert all(u["grad_norm"] == 0.0 and u["loss"] == 0.0 for u in trained), trained
